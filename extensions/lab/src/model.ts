/**
 * The state behind the Danlu UI, free of widgets.
 *
 * `QueueModel` polls this user's jobs (and, for admins, the team queues) with a
 * @lumino/polling `Poll`: it stands by while the page is hidden, backs off
 * exponentially while the server fails, and refreshes on demand. The sidebar,
 * the cell badges and the submit command all read the one shared instance.
 * Beside the jobs it reads the cull warnings of this user's notebook servers
 * (a server holding an idle GPU that is about to be stopped).
 * `ExperimentsModel` holds the experiments, one experiment's runs, the selected
 * runs and the metric history that the comparison chart draws.
 * The pure helpers at the end turn a notebook's `parameters` cell into fields and
 * the submit form into the `%%train` command the kernel runs.
 */
import { ISignal, Signal } from '@lumino/signaling';

import { DanluService } from './handler';
import { messageOf, PolledModel } from './polled';
import {
  IExperiment,
  IJob,
  IMetricHistory,
  IModelVersion,
  IQueue,
  IRun,
  IShownCullWarning,
  IWhoami,
  MODEL_NAME_PATTERN
} from './tokens';

/** What a view shows: a spinner, an error with Retry, an empty note, or the data. */
export type ViewStatus = 'loading' | 'error' | 'empty' | 'ready';

export namespace QueueModel {
  export interface IOptions extends PolledModel.IOptions {
    service: DanluService;
  }
}

/** This user's jobs, and for admins the team queues, kept fresh by a `Poll` (it starts at once by default). */
export class QueueModel extends PolledModel {
  constructor(options: QueueModel.IOptions) {
    super('danlu:queue', options, true);
    this.service = options.service;
  }

  readonly service: DanluService;

  get jobs(): readonly IJob[] {
    return this._jobs;
  }

  get queues(): readonly IQueue[] {
    return this._queues;
  }

  get whoami(): IWhoami | null {
    return this._whoami;
  }

  get isAdmin(): boolean {
    return !!this._whoami?.admin;
  }

  get status(): ViewStatus {
    if (this.error !== null) {
      return 'error';
    }
    if (!this.loaded) {
      return 'loading';
    }
    return this._jobs.length ? 'ready' : 'empty';
  }

  /** A job of this user by id, from the last poll. */
  job(id: string): IJob | undefined {
    return this._jobs.find(job => job.id === id);
  }

  /**
   * The cull warnings of this user's notebook servers, from the last poll that
   * could read them: a failed read keeps the previous ones (their countdown
   * goes on), a service without GPU-aware culling gives none.
   */
  get cullWarnings(): readonly IShownCullWarning[] {
    return this._cullWarnings;
  }

  protected async load(): Promise<void> {
    // In parallel with the jobs, and never failing the poll: the warnings are
    // read even when the jobs fail, and their failure is no error of the queue.
    const warnings = this._readCullWarnings();
    try {
      if (this._whoami === null) {
        this._whoami = await this.service.whoami();
      }
      const [jobs, queues] = await Promise.all([
        this.service.jobs(),
        this.isAdmin ? this.service.queues() : Promise.resolve([])
      ]);
      this._jobs = jobs;
      this._queues = queues;
    } finally {
      this._cullWarnings = (await warnings) ?? this._cullWarnings;
    }
  }

  /** The warnings with their deadline on this browser's clock; null when they could not be read. */
  private async _readCullWarnings(): Promise<IShownCullWarning[] | null> {
    try {
      const warnings = await this.service.cullWarnings();
      const now = Date.now();
      return warnings.map(warning => ({
        ...warning,
        deadline: now + Math.max(0, Number(warning.seconds_left) || 0) * 1000
      }));
    } catch {
      return null;
    }
  }

  private _cullWarnings: IShownCullWarning[] = [];
  private _jobs: IJob[] = [];
  private _queues: IQueue[] = [];
  private _whoami: IWhoami | null = null;
}

/** Loading state of one part of the experiments view. */
export interface ILoadable {
  status: ViewStatus | 'idle';
  error: string | null;
}

/** Experiments, one experiment's runs, the selected runs and the metric comparison. */
export class ExperimentsModel {
  constructor(options: { service: DanluService }) {
    this.service = options.service;
  }

  readonly service: DanluService;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get experiments(): readonly IExperiment[] {
    return this._experiments;
  }
  get experimentsState(): ILoadable {
    return this._experimentsState;
  }

  get selectedExperiment(): string | null {
    return this._selectedExperiment;
  }

  get runs(): readonly IRun[] {
    return this._runs;
  }
  get runsState(): ILoadable {
    return this._runsState;
  }

  /** Ids of the checked runs. */
  get selection(): ReadonlySet<string> {
    return this._selection;
  }

  /** The checked runs, in table order. */
  get selectedRuns(): IRun[] {
    return this._runs.filter(run => this._selection.has(run.run_id));
  }

  /** Every parameter name among the runs, sorted. */
  get paramKeys(): string[] {
    return unionKeys(this._runs.map(run => run.params ?? {}));
  }

  /** Every metric name among the runs, sorted. */
  get metricKeys(): string[] {
    return unionKeys(this._runs.map(run => run.metrics ?? {}));
  }

  /** The metric the chart shows, once Compare was pressed. */
  get compareKey(): string | null {
    return this._compareKey;
  }
  get history(): IMetricHistory | null {
    return this._history;
  }
  get historyState(): ILoadable {
    return this._historyState;
  }

  /** Load the experiments that hold this user's runs. */
  async loadExperiments(): Promise<void> {
    const generation = ++this._experimentsGeneration;
    this._experimentsState = { status: 'loading', error: null };
    this._changed.emit();
    try {
      const experiments = await this.service.experiments();
      if (generation !== this._experimentsGeneration) {
        return;
      }
      this._experiments = experiments;
      this._experimentsState = {
        status: experiments.length ? 'ready' : 'empty',
        error: null
      };
    } catch (error) {
      if (generation !== this._experimentsGeneration) {
        return;
      }
      this._experimentsState = { status: 'error', error: messageOf(error) };
    }
    this._changed.emit();
  }

  /** Show one experiment's runs; clears the selection and the comparison. */
  async selectExperiment(id: string | null): Promise<void> {
    const generation = ++this._runsGeneration;
    this._selectedExperiment = id;
    this._runs = [];
    this._selection = new Set();
    this._clearComparison();
    this._runsState = id
      ? { status: 'loading', error: null }
      : { status: 'idle', error: null };
    this._changed.emit();
    if (!id) {
      return;
    }
    try {
      const runs = await this.service.runs(id);
      if (generation !== this._runsGeneration) {
        return;
      }
      this._runs = runs;
      this._runsState = {
        status: runs.length ? 'ready' : 'empty',
        error: null
      };
    } catch (error) {
      if (generation !== this._runsGeneration) {
        return;
      }
      this._runsState = { status: 'error', error: messageOf(error) };
    }
    this._changed.emit();
  }

  /** Reload the runs of the selected experiment, keeping the checked runs that remain. */
  async reloadRuns(): Promise<void> {
    const keep = this._selection;
    await this.selectExperiment(this._selectedExperiment);
    this._selection = new Set(
      this._runs.map(run => run.run_id).filter(id => keep.has(id))
    );
    this._changed.emit();
  }

  /** Check or uncheck a run (toggles when `selected` is omitted). */
  toggleRun(runId: string, selected?: boolean): void {
    if (!this._runs.some(run => run.run_id === runId)) {
      return;
    }
    const next = new Set(this._selection);
    const on = selected ?? !next.has(runId);
    if (on) {
      next.add(runId);
    } else {
      next.delete(runId);
    }
    this._selection = next;
    this._changed.emit();
  }

  /** Check or uncheck every run. */
  selectAll(selected: boolean): void {
    this._selection = new Set(
      selected ? this._runs.map(run => run.run_id) : []
    );
    this._changed.emit();
  }

  /** The model versions registered from a run since the page loaded, oldest first. */
  registeredFrom(runId: string): readonly IModelVersion[] {
    return this._registered.get(runId) ?? [];
  }

  /** Remember a version that `POST models` registered, so the run's row shows it. */
  noteRegistered(version: IModelVersion): void {
    const list = this._registered.get(version.run_id) ?? [];
    this._registered.set(version.run_id, [
      ...list.filter(
        v =>
          !(
            v.name === version.name &&
            String(v.version) === String(version.version)
          )
      ),
      version
    ]);
    this._changed.emit();
  }

  /**
   * Fetch one metric's history for the checked runs. The key defaults to the
   * current one, else `loss` when the runs have it, else their first metric.
   */
  async compare(key?: string): Promise<void> {
    const runIds = this.selectedRuns.map(run => run.run_id);
    const keys = unionKeys(this.selectedRuns.map(run => run.metrics ?? {}));
    const metric =
      key ??
      (this._compareKey && keys.includes(this._compareKey)
        ? this._compareKey
        : keys.includes('loss')
          ? 'loss'
          : keys[0]);
    const generation = ++this._historyGeneration;
    this._compareKey = metric ?? null;
    if (!runIds.length || !metric) {
      this._history = null;
      this._historyState = {
        status: 'error',
        error: runIds.length
          ? 'The selected runs logged no metrics.'
          : 'Select at least one run to compare.'
      };
      this._changed.emit();
      return;
    }
    this._historyState = { status: 'loading', error: null };
    this._changed.emit();
    try {
      const history = await this.service.metricHistory(runIds, metric);
      if (generation !== this._historyGeneration) {
        return;
      }
      this._history = history;
      const points = history.series.reduce((n, s) => n + s.points.length, 0);
      this._historyState = { status: points ? 'ready' : 'empty', error: null };
    } catch (error) {
      if (generation !== this._historyGeneration) {
        return;
      }
      this._history = null;
      this._historyState = { status: 'error', error: messageOf(error) };
    }
    this._changed.emit();
  }

  private _clearComparison(): void {
    this._historyGeneration++;
    this._compareKey = null;
    this._history = null;
    this._historyState = { status: 'idle', error: null };
  }

  private _changed = new Signal<this, void>(this);
  private _compareKey: string | null = null;
  private _experiments: IExperiment[] = [];
  private _experimentsGeneration = 0;
  private _experimentsState: ILoadable = { status: 'idle', error: null };
  private _history: IMetricHistory | null = null;
  private _historyGeneration = 0;
  private _historyState: ILoadable = { status: 'idle', error: null };
  private _runs: IRun[] = [];
  private _runsGeneration = 0;
  private _runsState: ILoadable = { status: 'idle', error: null };
  private _selectedExperiment: string | null = null;
  private _selection: Set<string> = new Set();
  private _registered = new Map<string, IModelVersion[]>();
}

function unionKeys(records: Record<string, unknown>[]): string[] {
  const keys = new Set<string>();
  for (const record of records) {
    Object.keys(record).forEach(key => keys.add(key));
  }
  return [...keys].sort();
}

/* ------------------------------------------------------------------------ */
/* Pure helpers of "Run cell as training job".                              */
/* ------------------------------------------------------------------------ */

/** One assignment of a `parameters` cell. */
export interface IParameter {
  name: string;
  /** The value as written (Python source), without a trailing comment. */
  value: string;
}

const ASSIGNMENT = /^([A-Za-z_][A-Za-z0-9_]*)\s*(?::[^=]+)?=(?!=)\s*(.*)$/;

/**
 * The `name = value` lines of a parameters cell (papermill's convention), in
 * order; a later assignment of the same name wins. Comments, blank lines,
 * indented lines and lines that are not a plain assignment are skipped, and a
 * trailing `# comment` is dropped unless the `#` sits inside a string.
 */
export function parseParameters(source: string): IParameter[] {
  const found = new Map<string, string>();
  for (const line of source.split(/\r?\n/)) {
    if (!line || /^\s/.test(line)) {
      continue;
    }
    const match = ASSIGNMENT.exec(line);
    if (!match) {
      continue;
    }
    const value = stripComment(match[2]).trim();
    if (value) {
      found.delete(match[1]);
      found.set(match[1], value);
    }
  }
  return [...found].map(([name, value]) => ({ name, value }));
}

function stripComment(text: string): string {
  let quote: string | null = null;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (quote) {
      if (c === '\\') {
        i++;
      } else if (c === quote) {
        quote = null;
      }
    } else if (c === '"' || c === "'") {
      quote = c;
    } else if (c === '#') {
      return text.slice(0, i);
    }
  }
  return text;
}

/** The cells of a notebook as the parser needs them. */
export interface ICellLike {
  source: string;
  tags?: readonly string[] | null;
}

/** The parameters of the first cell tagged `parameters`, or none. */
export function notebookParameters(cells: Iterable<ICellLike>): IParameter[] {
  for (const cell of cells) {
    if (cell.tags && cell.tags.includes('parameters')) {
      return parseParameters(cell.source);
    }
  }
  return [];
}

/** What the submit dialog asks for; empty strings mean "the default". */
export interface ISubmitOptions {
  profile?: string;
  nproc?: string;
  gpus?: string;
  queue?: string;
  priority?: string;
  params?: Record<string, string>;
}

/** The line the kernel runs first, so that `%%train` exists. */
export const LOAD_EXTENSION = '%load_ext danlu';

/** The user expression that reads the submitted job's id back. */
export const JOB_ID_EXPRESSION = '__import__("danlu").last_job_id()';

const SIMPLE_TOKEN = /^[A-Za-z0-9_.:@/+,=-]+$/;

/** A user mistake in the submit form, shown as is. */
export class FormError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'FormError';
  }
}

function intOption(flag: string, value: string | undefined): string[] {
  const text = (value ?? '').trim();
  if (!text) {
    return [];
  }
  if (!/^\d+$/.test(text)) {
    throw new FormError(`${flag} must be a whole number, not "${text}".`);
  }
  return [flag, String(parseInt(text, 10))];
}

function nameOption(flag: string, value: string | undefined): string[] {
  const text = (value ?? '').trim();
  if (!text) {
    return [];
  }
  if (!SIMPLE_TOKEN.test(text)) {
    throw new FormError(
      `${flag} "${text}" may hold only letters, digits and . _ - : @ /`
    );
  }
  return [flag, text];
}

/**
 * One `--param` argument as IPython's `arg_split` (shlex, non-POSIX) reads it:
 * bare when it is one simple word, else the whole `k=v` in quotes, which
 * `danlu.submit.parse_param` strips again.
 */
export function paramArgument(name: string, value: string): string {
  const pair = `${name}=${value}`;
  if (/[\r\n]/.test(value)) {
    throw new FormError(`Parameter ${name}: the value must fit on one line.`);
  }
  if (SIMPLE_TOKEN.test(pair)) {
    return pair;
  }
  if (!pair.includes("'")) {
    return `'${pair}'`;
  }
  if (!pair.includes('"')) {
    return `"${pair}"`;
  }
  throw new FormError(
    `Parameter ${name}: the value may not hold both ' and " quotes.`
  );
}

/** The `%%train --no-wait --quiet ...` line of a submission. */
export function trainCommand(options: ISubmitOptions): string {
  const args = ['%%train', '--no-wait', '--quiet'];
  args.push(...intOption('--nproc', options.nproc));
  args.push(...intOption('--gpus', options.gpus));
  args.push(...nameOption('--profile', options.profile));
  args.push(...nameOption('--queue', options.queue));
  args.push(...nameOption('--priority', options.priority));
  for (const [name, value] of Object.entries(options.params ?? {})) {
    if (value.trim()) {
      args.push('--param', paramArgument(name, value.trim()));
    }
  }
  return args.join(' ');
}

/** The code the kernel runs for a submission: the `%%train` line, then the cell. */
export function trainCellCode(options: ISubmitOptions, source: string): string {
  return `${trainCommand(options)}\n${source}`;
}

/**
 * The job id from the `user_expressions` of an execute reply (the repr of a
 * `str`, or `None`); null when no id came back.
 */
export function jobIdFromReply(
  expressions: Record<string, any> | undefined,
  key = 'job_id'
): string | null {
  const result = expressions?.[key];
  if (!result || result.status !== 'ok') {
    return null;
  }
  const text: string = (result.data?.['text/plain'] ?? '').trim();
  const match = /^(['"])(.*)\1$/.exec(text);
  if (!match || !match[2]) {
    return null;
  }
  return match[2];
}

/**
 * What is wrong with a model name, in a sentence that says how to fix it; null
 * when it is a name the jobs service accepts (MODEL_NAME_PATTERN).
 */
export function modelNameProblem(name: string): string | null {
  if (!name) {
    return 'Give the model a name, e.g. mnist-classifier.';
  }
  if (MODEL_NAME_PATTERN.test(name)) {
    return null;
  }
  if (name.length > 63) {
    return `The name is ${name.length} characters long: a model name has at most 63.`;
  }
  if (!/^[A-Za-z0-9]/.test(name)) {
    return 'A model name starts with a letter or a digit.';
  }
  const bad = [...name].find(ch => !/[-A-Za-z0-9_.]/.test(ch)) ?? '';
  return `"${bad}" cannot be in a model name: use letters, digits, "-", "_" and ".".`;
}

/** `NAME@VERSION` (what `danlu lineage` takes) as a name and a version number; FormError if it is not one. */
export function parseModelRef(text: string): { name: string; version: string } {
  const value = text.trim();
  const at = value.lastIndexOf('@');
  const name = at >= 0 ? value.slice(0, at) : value;
  const version = at >= 0 ? value.slice(at + 1) : '';
  const problem = modelNameProblem(name);
  if (problem) {
    throw new FormError(problem);
  }
  if (!/^[1-9][0-9]{0,8}$/.test(version)) {
    throw new FormError(
      `Say which version of ${name}: ${name}@VERSION, e.g. ${name}@1.`
    );
  }
  return { name, version };
}
