/**
 * The pure helpers of "Run cell as training job": the parameters-cell parser,
 * the %%train command line and the job id read from the execute reply.
 */
import {
  FormError,
  JOB_ID_EXPRESSION,
  LOAD_EXTENSION,
  jobIdFromReply,
  notebookParameters,
  paramArgument,
  parseParameters,
  trainCellCode,
  trainCommand
} from '../model';

describe('parseParameters', () => {
  it('reads name = value lines in order', () => {
    const source = [
      'lr = 0.01',
      'epochs=3',
      'name = "mnist"',
      'layers = [64, 32]'
    ].join('\n');
    expect(parseParameters(source)).toEqual([
      { name: 'lr', value: '0.01' },
      { name: 'epochs', value: '3' },
      { name: 'name', value: '"mnist"' },
      { name: 'layers', value: '[64, 32]' }
    ]);
  });

  it('drops comments, but not a # inside a string', () => {
    const source = [
      '# the parameters',
      '',
      'lr = 0.1  # learning rate',
      "tag = 'a#b'  # kept",
      'url = "http://x/#frag"'
    ].join('\n');
    expect(parseParameters(source)).toEqual([
      { name: 'lr', value: '0.1' },
      { name: 'tag', value: "'a#b'" },
      { name: 'url', value: '"http://x/#frag"' }
    ]);
  });

  it('skips what is not a plain assignment', () => {
    const source = [
      'import os',
      'x == 1',
      'if True:',
      '    y = 2',
      'a, b = 1, 2',
      'c += 1',
      'd =',
      'steps: int = 100',
      'ok = True'
    ].join('\r\n');
    expect(parseParameters(source)).toEqual([
      { name: 'steps', value: '100' },
      { name: 'ok', value: 'True' }
    ]);
  });

  it('keeps the last assignment of a name', () => {
    expect(parseParameters('lr = 1\nbs = 2\nlr = 3')).toEqual([
      { name: 'bs', value: '2' },
      { name: 'lr', value: '3' }
    ]);
  });

  it('reads the first cell tagged parameters', () => {
    const cells = [
      { source: 'lr = 9', tags: null },
      { source: 'lr = 0.5', tags: ['setup', 'parameters'] },
      { source: 'lr = 7', tags: ['parameters'] }
    ];
    expect(notebookParameters(cells)).toEqual([{ name: 'lr', value: '0.5' }]);
    expect(notebookParameters([{ source: 'lr = 1' }])).toEqual([]);
  });
});

describe('trainCommand', () => {
  it('always runs without waiting and quietly', () => {
    expect(trainCommand({})).toBe('%%train --no-wait --quiet');
  });

  it('adds the options that are filled in', () => {
    expect(
      trainCommand({
        profile: 'pytorch-gpu',
        nproc: '2',
        gpus: ' 1 ',
        queue: 'team-a',
        priority: 'high',
        params: { lr: '0.01', name: '"mnist"', layers: '[64, 32]', empty: ' ' }
      })
    ).toBe(
      '%%train --no-wait --quiet --nproc 2 --gpus 1 --profile pytorch-gpu --queue team-a ' +
        `--priority high --param lr=0.01 --param 'name="mnist"' --param 'layers=[64, 32]'`
    );
  });

  it('refuses what %%train could not read', () => {
    expect(() => trainCommand({ nproc: 'two' })).toThrow(FormError);
    expect(() => trainCommand({ gpus: '-1' })).toThrow(
      /--gpus must be a whole number/
    );
    expect(() => trainCommand({ queue: 'team a' })).toThrow(/--queue/);
    expect(() => trainCommand({ params: { s: `"it's"` + "'" } })).toThrow(
      /both ' and "/
    );
  });

  it('quotes a parameter so that parse_param gets k=v back', () => {
    expect(paramArgument('opt', 'adam')).toBe('opt=adam');
    expect(paramArgument('opt', "'adam'")).toBe(`"opt='adam'"`);
    expect(paramArgument('msg', 'a b')).toBe("'msg=a b'");
    expect(() => paramArgument('msg', 'a\nb')).toThrow(/one line/);
  });

  it('puts the cell after the %%train line', () => {
    expect(trainCellCode({ nproc: '1' }, 'train()\nprint(1)')).toBe(
      '%%train --no-wait --quiet --nproc 1\ntrain()\nprint(1)'
    );
    expect(LOAD_EXTENSION).toBe('%load_ext danlu');
    expect(JOB_ID_EXPRESSION).toBe('__import__("danlu").last_job_id()');
  });
});

describe('jobIdFromReply', () => {
  const ok = (text: string) => ({
    job_id: { status: 'ok', data: { 'text/plain': text }, metadata: {} }
  });

  it("reads the repr of the id's str", () => {
    expect(jobIdFromReply(ok("'7f3a2c'"))).toBe('7f3a2c');
    expect(jobIdFromReply(ok('"7f3a2c"'))).toBe('7f3a2c');
  });

  it('is null for None, an error or nothing', () => {
    expect(jobIdFromReply(ok('None'))).toBeNull();
    expect(jobIdFromReply(ok("''"))).toBeNull();
    expect(
      jobIdFromReply({
        job_id: { status: 'error', ename: 'AttributeError', evalue: 'x' }
      })
    ).toBeNull();
    expect(jobIdFromReply({})).toBeNull();
    expect(jobIdFromReply(undefined)).toBeNull();
  });
});
