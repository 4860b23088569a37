/**
 * The "Run cell as training job" dialog: profile, processes, GPUs, queue,
 * priority and one field per parameter of the notebook's `parameters` cell.
 *
 * The form is uncontrolled; `getValue()` reads the named fields, which keeps the
 * field names (`profile`, `nproc`, `gpus`, `queue`, `priority`, `param-<name>`)
 * the single source of truth for the UI tests and for the submission.
 */
import { Dialog, ReactWidget, showDialog } from '@jupyterlab/apputils';
import * as React from 'react';

import { IParameter, ISubmitOptions } from '../model';
import { IProfile } from '../tokens';

export interface ISubmitFormOptions {
  /** The cell's first line or the notebook name, for the dialog's text. */
  what: string;
  profiles: IProfile[];
  defaultProfile?: string | null;
  /** Why the profiles could not be listed, if they could not. */
  profilesError?: string | null;
  parameters: IParameter[];
  /** Values of an earlier attempt, to show again after a form error. */
  previous?: ISubmitOptions;
}

export class SubmitForm extends ReactWidget {
  constructor(readonly options: ISubmitFormOptions) {
    super();
    this.addClass('danlu-submit-form');
  }

  getValue(): ISubmitOptions {
    const value = (name: string) =>
      (
        this.node.querySelector(`[name="${name}"]`) as
          HTMLInputElement | HTMLSelectElement | null
      )?.value ?? '';
    const params: Record<string, string> = {};
    for (const p of this.options.parameters) {
      params[p.name] = value(`param-${p.name}`);
    }
    return {
      profile: value('profile'),
      nproc: value('nproc'),
      gpus: value('gpus'),
      queue: value('queue'),
      priority: value('priority'),
      params
    };
  }

  render(): JSX.Element {
    const o = this.options;
    const prev = o.previous ?? {};
    const profile =
      prev.profile ??
      o.defaultProfile ??
      o.profiles.find(p => p.default)?.slug ??
      '';
    return (
      <form className="danlu-form" onSubmit={e => e.preventDefault()}>
        <p className="danlu-form-intro">
          Runs {o.what} as a job on the cluster, with the cells it needs.
        </p>
        <label>
          <span>Profile</span>
          {o.profilesError ? (
            <input
              name="profile"
              type="text"
              defaultValue={prev.profile ?? ''}
            />
          ) : (
            <select name="profile" defaultValue={profile}>
              <option value="">This server's profile</option>
              {o.profiles.map(p => (
                <option key={p.slug} value={p.slug}>
                  {p.display_name || p.slug}
                </option>
              ))}
            </select>
          )}
        </label>
        {o.profilesError && (
          <p className="danlu-form-note">
            The profiles could not be listed: {o.profilesError}
          </p>
        )}
        <label>
          <span>Processes</span>
          <input
            name="nproc"
            type="number"
            min={1}
            defaultValue={prev.nproc ?? '1'}
          />
        </label>
        <label>
          <span>GPUs</span>
          <input
            name="gpus"
            type="number"
            min={0}
            defaultValue={prev.gpus ?? '0'}
          />
        </label>
        <label>
          <span>Queue</span>
          <input
            name="queue"
            type="text"
            placeholder="your team's queue"
            defaultValue={prev.queue ?? ''}
          />
        </label>
        <label>
          <span>Priority</span>
          <input
            name="priority"
            type="text"
            placeholder="the default class"
            defaultValue={prev.priority ?? ''}
          />
        </label>
        <fieldset className="danlu-form-params">
          <legend>Parameters</legend>
          {o.parameters.length === 0 && (
            <p className="danlu-form-note">
              No cell tagged <code>parameters</code> with{' '}
              <code>name = value</code> lines.
            </p>
          )}
          {o.parameters.map(p => (
            <label key={p.name}>
              <span>{p.name}</span>
              <input
                name={`param-${p.name}`}
                type="text"
                defaultValue={prev.params?.[p.name] ?? p.value}
              />
            </label>
          ))}
        </fieldset>
      </form>
    );
  }
}

/** Show the dialog; resolves with the form's values, or null when cancelled. */
export async function showSubmitDialog(
  options: ISubmitFormOptions
): Promise<ISubmitOptions | null> {
  const body = new SubmitForm(options);
  const result = await showDialog<ISubmitOptions>({
    title: 'Run cell as training job',
    body,
    buttons: [
      Dialog.cancelButton({ label: 'Cancel' }),
      Dialog.okButton({ label: 'Submit' })
    ],
    focusNodeSelector: '[name="profile"]'
  });
  return result.button.accept ? result.value : null;
}
