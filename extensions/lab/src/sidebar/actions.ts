/**
 * What the sidebar asks of the application: it never opens dialogs or widgets
 * itself, `index.ts` implements these with the app's commands.
 */
import { IJob, IModelVersion, IRun } from '../tokens';

export interface ISidebarActions {
  /** Ask for confirmation, then cancel the job. */
  cancel(job: IJob): Promise<void>;
  /** Save the executed notebook and open it. */
  openOutput(job: IJob): Promise<void>;
  /** Open a TensorBoard tab over these jobs' or runs' logs. */
  openTensorBoard(
    target: { job_ids: string[] } | { run_ids: string[] },
    label: string
  ): Promise<void>;
  /**
   * Ask for a model name and register the run's model: the new version, or
   * null when cancelled or refused (the action has shown why).
   */
  registerModel(run: IRun): Promise<IModelVersion | null>;
  /** Open the lineage graph of a model version in the main area. */
  openLineage(name: string, version: string | number): Promise<void>;
  /** Open a sweep (trials, curve, parameters against the objective) in the main area. */
  openSweep(id: string, name: string): Promise<void>;
}
