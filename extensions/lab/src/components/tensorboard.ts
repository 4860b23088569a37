/**
 * The TensorBoard main-area tab: a sandboxed iframe on the TensorBoard that the
 * server extension proxies under `{base_url}danlu/tensorboard/<id>/`.
 */
import { IFrame, MainAreaWidget } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';

import { ITensorBoard } from '../tokens';
import { danluIcon } from './icons';

/** The widget id of a TensorBoard tab (one per distinct set of logs). */
export function tensorBoardWidgetId(id: string): string {
  return `danlu-tensorboard-${id}`;
}

/** The iframe's address: the server's URL, made absolute against the base URL. */
export function tensorBoardUrl(tb: ITensorBoard, baseUrl: string): string {
  if (/^(https?:)?\//.test(tb.url)) {
    return tb.url;
  }
  return URLExt.join(baseUrl, tb.url);
}

export function createTensorBoardWidget(
  tb: ITensorBoard,
  label: string,
  baseUrl: string
): MainAreaWidget<IFrame> {
  const content = new IFrame({
    sandbox: ['allow-scripts', 'allow-same-origin'],
    referrerPolicy: 'same-origin'
  });
  content.url = tensorBoardUrl(tb, baseUrl);
  content.addClass('danlu-tensorboard');
  const widget = new MainAreaWidget({ content });
  widget.id = tensorBoardWidgetId(tb.id);
  widget.title.label = label ? `TensorBoard: ${label}` : 'TensorBoard';
  widget.title.caption = `TensorBoard over ${Object.keys(tb.logdirs ?? {}).join(', ')}`;
  widget.title.icon = danluIcon;
  widget.title.closable = true;
  return widget;
}
