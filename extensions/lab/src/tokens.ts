/**
 * Shared types, command ids and the plugin token of the Danlu lab extension.
 *
 * The JSON shapes mirror the REST list of the server extension under
 * `{base_url}danlu/api/` (see extensions/README.md); the job shape is the jobs
 * service's own job JSON, of which the UI reads only the fields named here.
 */
import { Token } from '@lumino/coreutils';

import type { DanluService } from './handler';
import type { ExperimentsModel, QueueModel } from './model';
import type { SweepsModel } from './sweeps';

/** Command ids, stable: the UI tests and the cell toolbar setting use them. */
export namespace CommandIDs {
  export const runCellAsJob = 'danlu:run-cell-as-job';
  export const openTensorBoard = 'danlu:open-tensorboard';
  export const refresh = 'danlu:refresh';
  /** Args `{name, version}`: the lineage graph of a model version in the main area. */
  export const openLineage = 'danlu:open-lineage';
  /** Args `{id, name?}`: one sweep (trials, best-so-far curve, parameters against the objective) in the main area. */
  export const openSweep = 'danlu:open-sweep';
}

/** Id of the left sidebar widget. */
export const SIDEBAR_ID = 'danlu-sidebar';

/** The states of a job, as the jobs service's state machine names them. */
export type JobState =
  | 'queued'
  | 'running'
  | 'preempted'
  | 'succeeded'
  | 'failed'
  | 'cancelled'
  | 'timed_out';

/** States after which a job never changes again. */
export const FINAL_STATES: ReadonlySet<string> = new Set([
  'succeeded',
  'failed',
  'cancelled',
  'timed_out'
]);

export interface IWhoami {
  user: string;
  admin: boolean;
  hub_url: string;
  mlflow_url: string | null;
}

export interface IProfile {
  slug: string;
  display_name: string;
  description?: string;
  default?: boolean;
  [key: string]: unknown;
}

/** A job's last checkpoint, as its code reported it (kept across attempts). */
export interface ICheckpoint {
  step: number;
  /** Seconds since it was saved (for a job that ended: until it ended). */
  age_seconds: number;
  attempt: number;
}

export interface IJob {
  id: string;
  name: string;
  owner: string;
  state: JobState | string;
  reason?: string;
  queue?: string;
  priority?: string | null;
  queue_position?: number | null;
  estimated_start?: string | null;
  resources?: { nproc?: number; gpus?: number; [key: string]: unknown };
  devices?: number[];
  elapsed_seconds?: number | null;
  created_at: string;
  started_at?: string | null;
  finished_at?: string | null;
  mlflow_run_id?: string | null;
  mlflow_run_url?: string | null;
  checkpoint?: ICheckpoint | null;
  [key: string]: unknown;
}

/** Resource amounts of a queue: `{"gpus": {"<flavor>": n}, "cpu": n, ...}`. */
export interface IAmounts {
  gpus?: Record<string, number>;
  [key: string]: unknown;
}

export interface IQueue {
  name: string;
  cohort?: string | null;
  held?: boolean;
  quota: IAmounts;
  usage: IAmounts;
  borrowing?: Record<string, number>;
  pending: number;
  running: number;
  [key: string]: unknown;
}

export interface IExperiment {
  experiment_id: string;
  name: string;
  runs: number;
}

export interface IRun {
  run_id: string;
  run_name: string;
  status: string;
  start_time: number | string | null;
  end_time: number | string | null;
  params: Record<string, string>;
  metrics: Record<string, number>;
  job_id: string | null;
  mlflow_url: string | null;
}

export interface IMetricSeries {
  run_id: string;
  run_name: string;
  points: [number, number][];
}

export interface IMetricHistory {
  key: string;
  series: IMetricSeries[];
}

export interface ITensorBoard {
  id: string;
  url: string;
  logdirs: Record<string, string>;
}

/** A model name, as the jobs service accepts it. */
export const MODEL_NAME_PATTERN = /^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$/;

/** Where a model version stands, as the jobs service's approval names it. */
export type ApprovalState = 'pending' | 'approved' | 'rejected';

/** The kinds of node of a lineage graph (GET lineage/models/{name}/{version}). */
export type LineageNodeKind =
  | 'model_version'
  | 'approval'
  | 'evaluation'
  | 'run'
  | 'job'
  | 'notebook'
  | 'cell'
  | 'dataset_version'
  | 'environment';

/** The evaluation gate of a model version: its job, its metrics against the thresholds. */
export interface IModelEvaluation {
  state: string;
  job_id?: string | null;
  metrics?: Record<string, number>;
  thresholds?: Record<string, unknown>;
  /** Why the gate failed, one sentence per metric below its threshold. */
  failures?: string[];
}

export interface IModelDecision {
  actor: string;
  decision: string;
  comment?: string | null;
  at: string;
}

/** A registered model version (`POST models` answers one). */
export interface IModelVersion {
  name: string;
  version: number | string;
  run_id: string;
  job_id?: string | null;
  source?: string | null;
  approval: ApprovalState | string;
  evaluation?: IModelEvaluation | null;
  decisions?: IModelDecision[];
  aliases?: string[];
}

export interface IModelSummary {
  name: string;
  latest_version: number | string | null;
  aliases: Record<string, number | string>;
}

export interface ILineageNode {
  id: string;
  kind: LineageNodeKind | string;
  label: string;
  detail?: Record<string, string | number | boolean | null>;
  url?: string | null;
}

/** An edge points from the derived thing to its input (model_version -> run -> job). */
export interface ILineageEdge {
  from: string;
  to: string;
  relation: string;
}

export interface ILineage {
  model: {
    name: string;
    version: number | string;
    approval: ApprovalState | string;
    aliases?: string[] | Record<string, unknown>;
  };
  nodes: ILineageNode[];
  edges: ILineageEdge[];
}

/** Where a sweep stands (the jobs service's SweepSummary `state`). */
export type SweepState = 'running' | 'succeeded' | 'stopped' | 'failed';

/** Where a trial of a sweep stands (the jobs service's SweepTrial `state`). */
export type SweepTrialState =
  'running' | 'complete' | 'pruned' | 'failed' | 'stopped';

/** One searched parameter: `lr=loguniform(1e-4,1e-1)` as `{name, distribution, low, high, text}`. */
export interface ISweepDimension {
  name: string;
  distribution: 'uniform' | 'loguniform' | 'int' | 'choice' | string;
  low?: number;
  high?: number;
  choices?: unknown[];
  text: string;
}

export interface ISweepObjective {
  metric: string;
  direction: 'minimize' | 'maximize' | string;
  text: string;
}

export interface ISweepTrialCounts {
  running: number;
  complete: number;
  pruned: number;
  failed: number;
  stopped: number;
}

/** A sweep without its trials (`GET sweeps`). */
export interface ISweepSummary {
  id: string;
  name: string;
  owner: string;
  state: SweepState | string;
  reason: string;
  created_at: string | null;
  finished_at?: string | null;
  objective: ISweepObjective;
  space: ISweepDimension[];
  options: Record<string, unknown>;
  experiment: string;
  mlflow_run_id: string | null;
  counts: ISweepTrialCounts;
  best: {
    number: number;
    job_id: string | null;
    value: number;
    params: Record<string, unknown>;
  } | null;
  notes: string[];
}

/** One trial: an ordinary job of the owner's, with the parameters Optuna chose. */
export interface ISweepTrial {
  number: number;
  job_id: string | null;
  job_state: string | null;
  job_reason?: string;
  run_id?: string | null;
  attempts: number;
  preemptions: number;
  state: SweepTrialState | string;
  params: Record<string, unknown>;
  value: number | null;
  step: number | null;
  rungs: number;
  reason: string;
  created_at?: string | null;
  finished_at?: string | null;
}

/** One point of the best-so-far curve: after `trial` ended, the best value was `best`. */
export interface ISweepCurvePoint {
  trial: number;
  finished_at: string | null;
  value: number | null;
  best: number | null;
}

/** A sweep with its trials and best-so-far curve (`GET sweeps/{id}`). */
export interface ISweep extends ISweepSummary {
  mlflow_run_url: string | null;
  trials: ISweepTrial[];
  best_curve: ISweepCurvePoint[];
}

/**
 * A notebook server that holds an idle GPU and is about to be stopped (one
 * entry of the jobs service's `GET servers/warnings`; only the caller's own).
 */
export interface ICullWarning {
  /** The hub user, plus `:name` for a named server: `alice`, `alice:gpu`. */
  server: string;
  user: string;
  /** The server's name, `""` for the default server. */
  name: string;
  /** When the service stops the server (ISO time, the service's clock). */
  cull_at: string;
  /** Seconds from the answer to `cull_at`: the countdown starts from this, not from `cull_at`, so a skewed browser clock does not matter. */
  seconds_left: number;
  idle_minutes: number;
  /** The GPUs the server holds. */
  devices: number[];
  /** Why it is culled, one sentence without a final period. */
  reason: string;
  /** How to keep the server, in sentences. */
  keep: string;
}

/** A cull warning as the UI shows it: `deadline` is the browser's clock (ms) when the server will be stopped. */
export interface IShownCullWarning extends ICullWarning {
  deadline: number;
}

/** What the core plugin provides to the others: one service, one shared queue model. */
export interface IDanlu {
  readonly service: DanluService;
  readonly queue: QueueModel;
  readonly experiments: ExperimentsModel;
  readonly sweeps: SweepsModel;
}

export const IDanlu = new Token<IDanlu>(
  'danlu-lab:IDanlu',
  'The Danlu REST service and the shared queue, experiments and sweeps models.'
);
