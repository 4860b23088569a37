/**
 * The "Register model" dialog: one field, the model's name, checked against
 * the jobs service's pattern as it is typed and again on Register (the dialog
 * comes back with the problem until the name is right, or is cancelled).
 * `describeVersion` says in one line where a registered version stands.
 */
import { Dialog, ReactWidget, showDialog } from '@jupyterlab/apputils';
import * as React from 'react';

import { modelNameProblem } from '../model';
import { IModelVersion, IRun } from '../tokens';

export interface IRegisterFormOptions {
  run: IRun;
  /** The name of an earlier attempt, and what was wrong with it. */
  previous?: string;
  problem?: string | null;
}

function NameField(props: IRegisterFormOptions): JSX.Element {
  const [problem, setProblem] = React.useState<string | null>(
    props.problem ?? null
  );
  return (
    <form className="danlu-form" onSubmit={e => e.preventDefault()}>
      <p className="danlu-form-intro">
        Registers the model (or the artifacts) that run{' '}
        <strong>{props.run.run_name || props.run.run_id}</strong> logged as a
        new version of a model. It waits for approval; an evaluation may run
        first.
      </p>
      <label>
        <span>Model name</span>
        <input
          name="model-name"
          type="text"
          autoComplete="off"
          spellCheck={false}
          maxLength={200}
          placeholder="e.g. mnist-classifier"
          defaultValue={props.previous ?? ''}
          aria-invalid={problem ? true : undefined}
          aria-describedby="danlu-model-name-problem"
          onInput={e => {
            const value = e.currentTarget.value.trim();
            setProblem(value ? modelNameProblem(value) : null);
          }}
        />
      </label>
      <p
        id="danlu-model-name-problem"
        className="danlu-form-error"
        role="alert"
        hidden={!problem}
      >
        {problem}
      </p>
    </form>
  );
}

export class RegisterModelForm extends ReactWidget {
  constructor(readonly options: IRegisterFormOptions) {
    super();
    this.addClass('danlu-register-form');
  }

  getValue(): string {
    return (
      (
        this.node.querySelector(
          '[name="model-name"]'
        ) as HTMLInputElement | null
      )?.value ?? ''
    ).trim();
  }

  render(): JSX.Element {
    return <NameField {...this.options} />;
  }
}

/** Ask for a model name until it is a valid one; null when cancelled. */
export async function showRegisterModelDialog(
  run: IRun
): Promise<string | null> {
  let previous = '';
  let problem: string | null = null;
  for (;;) {
    const result = await showDialog<string>({
      title: 'Register model',
      body: new RegisterModelForm({ run, previous, problem }),
      buttons: [
        Dialog.cancelButton({ label: 'Cancel' }),
        Dialog.okButton({ label: 'Register' })
      ],
      focusNodeSelector: '[name="model-name"]'
    });
    if (!result.button.accept) {
      return null;
    }
    previous = result.value ?? '';
    problem = modelNameProblem(previous);
    if (!problem) {
      return previous;
    }
  }
}

/** Where a version stands, in one line: "mnist v3: approval pending, evaluation queued". */
export function describeVersion(version: IModelVersion): string {
  const parts = [`approval ${version.approval}`];
  const evaluation = version.evaluation;
  if (evaluation && evaluation.state) {
    parts.push(`evaluation ${evaluation.state}`);
  }
  if (evaluation?.failures?.length) {
    parts.push(evaluation.failures.join('; '));
  }
  return `${version.name} v${version.version}: ${parts.join(', ')}`;
}
