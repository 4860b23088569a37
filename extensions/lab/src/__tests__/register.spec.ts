/**
 * "Register model": the name check the dialog applies as it is typed and on
 * Register (the jobs service's pattern), NAME@VERSION for "Open model lineage",
 * the one-line state of a version, and the versions the Experiments rows remember.
 */
import { describeVersion } from '../components/register';
import {
  ExperimentsModel,
  FormError,
  modelNameProblem,
  parseModelRef
} from '../model';
import { IModelVersion, MODEL_NAME_PATTERN } from '../tokens';

describe('modelNameProblem', () => {
  it('accepts what the jobs service accepts', () => {
    for (const name of [
      'mnist',
      'mnist-classifier',
      'm.v2_final',
      '9lives',
      'a'.repeat(63)
    ]) {
      expect(modelNameProblem(name)).toBeNull();
      expect(MODEL_NAME_PATTERN.test(name)).toBe(true);
    }
  });

  it('says what is wrong and how to fix it', () => {
    expect(modelNameProblem('')).toMatch(/Give the model a name/);
    expect(modelNameProblem('a'.repeat(64))).toBe(
      'The name is 64 characters long: a model name has at most 63.'
    );
    expect(modelNameProblem('-mnist')).toBe(
      'A model name starts with a letter or a digit.'
    );
    expect(modelNameProblem('.hidden')).toBe(
      'A model name starts with a letter or a digit.'
    );
    expect(modelNameProblem('my model')).toBe(
      '" " cannot be in a model name: use letters, digits, "-", "_" and ".".'
    );
    expect(modelNameProblem('a/b')).toMatch(/^"\/" cannot be/);
    expect(modelNameProblem('modèle')).toMatch(/^"è" cannot be/);
    for (const bad of ['', '-x', 'a b', 'a/b', 'a'.repeat(64)]) {
      expect(MODEL_NAME_PATTERN.test(bad)).toBe(false);
    }
  });
});

describe('parseModelRef', () => {
  it('splits NAME@VERSION at the last @', () => {
    expect(parseModelRef(' mnist.v2@12 ')).toEqual({
      name: 'mnist.v2',
      version: '12'
    });
  });

  it('refuses a bad name or a missing version with a FormError', () => {
    expect(() => parseModelRef('mnist')).toThrow(FormError);
    expect(() => parseModelRef('mnist')).toThrow(
      'Say which version of mnist: mnist@VERSION, e.g. mnist@1.'
    );
    expect(() => parseModelRef('mnist@0')).toThrow(FormError);
    expect(() => parseModelRef('mnist@latest')).toThrow(FormError);
    expect(() => parseModelRef('my model@1')).toThrow(
      '" " cannot be in a model name'
    );
  });
});

describe('describeVersion', () => {
  const version: IModelVersion = {
    name: 'mnist',
    version: 2,
    run_id: 'r1',
    approval: 'pending',
    evaluation: { state: 'failed', failures: ['accuracy 0.81 < 0.9'] }
  };

  it('says the approval, the evaluation and why it failed', () => {
    expect(describeVersion(version)).toBe(
      'mnist v2: approval pending, evaluation failed, accuracy 0.81 < 0.9'
    );
    expect(
      describeVersion({ ...version, evaluation: null, approval: 'approved' })
    ).toBe('mnist v2: approval approved');
  });
});

describe('ExperimentsModel.noteRegistered', () => {
  it('remembers versions per run, once each, and says it changed', () => {
    const model = new ExperimentsModel({ service: {} as any });
    const changed = jest.fn();
    model.changed.connect(changed);
    const v1: IModelVersion = {
      name: 'mnist',
      version: 1,
      run_id: 'r1',
      approval: 'pending'
    };
    model.noteRegistered(v1);
    model.noteRegistered({ ...v1, approval: 'approved' });
    model.noteRegistered({ ...v1, version: 2 });
    expect(
      model.registeredFrom('r1').map(v => `${v.version}:${v.approval}`)
    ).toEqual(['1:approved', '2:pending']);
    expect(model.registeredFrom('r2')).toEqual([]);
    expect(changed).toHaveBeenCalledTimes(3);
  });
});
