/**
 * The lineage view of a model version: what made it, drawn as plain SVG.
 *
 * `layoutLineage` is pure (columns by kind, rows ordered to keep edges short,
 * one path per edge) so that Jest can check the geometry; `LineageGraph` draws
 * it with a detail panel for the clicked node; `LineageView` loads
 * `GET lineage/models/{name}/{version}` with the sidebar's loading and error
 * states; `createLineageWidget` puts it in a main-area tab.
 *
 * The jobs service's edges point from the derived thing to its input
 * (model_version -> run); the graph draws data flowing left to right, so each
 * arrow runs from the input (`edge.to`) to what was made from it (`edge.from`).
 */
import { MainAreaWidget, ReactWidget } from '@jupyterlab/apputils';
import { refreshIcon } from '@jupyterlab/ui-components';
import * as React from 'react';

import { ErrorState, IconButton, Loading } from '../sidebar/common';
import {
  ILineage,
  ILineageEdge,
  ILineageNode,
  LineageNodeKind
} from '../tokens';
import { formatNumber } from './format';
import { danluIcon } from './icons';

/** The columns, left (inputs) to right (decisions), and the kinds each holds. */
export const LINEAGE_COLUMNS: readonly {
  title: string;
  kinds: readonly LineageNodeKind[];
}[] = [
  { title: 'Data and environment', kinds: ['dataset_version', 'environment'] },
  { title: 'Notebook and cell', kinds: ['notebook', 'cell'] },
  { title: 'Job', kinds: ['job'] },
  { title: 'Run', kinds: ['run'] },
  { title: 'Evaluation', kinds: ['evaluation'] },
  { title: 'Model version', kinds: ['model_version'] },
  { title: 'Approval', kinds: ['approval'] }
];

/** How each kind is named on its boxes (a Record: a new kind fails to compile until named). */
export const KIND_LABELS: Record<LineageNodeKind, string> = {
  dataset_version: 'dataset version',
  environment: 'environment',
  notebook: 'notebook',
  cell: 'cell',
  job: 'job',
  run: 'MLflow run',
  evaluation: 'evaluation',
  model_version: 'model version',
  approval: 'approval'
};

/** The title of the last column, for kinds this version of the UI does not know. */
export const OTHER_COLUMN = 'Other';

export function kindLabel(kind: string): string {
  return (
    (KIND_LABELS as Record<string, string>)[kind] ?? kind.replace(/_/g, ' ')
  );
}

export interface ILineageLayoutOptions {
  nodeWidth: number;
  nodeHeight: number;
  columnGap: number;
  rowGap: number;
  padding: number;
  headerHeight: number;
}

export const DEFAULT_LINEAGE_LAYOUT: ILineageLayoutOptions = {
  nodeWidth: 184,
  nodeHeight: 52,
  columnGap: 64,
  rowGap: 16,
  padding: 16,
  headerHeight: 28
};

export interface IPlacedNode {
  node: ILineageNode;
  /** Index of its column among the columns drawn (empty ones are left out). */
  column: number;
  row: number;
  x: number;
  y: number;
  width: number;
  height: number;
}

export interface IPlacedEdge {
  edge: ILineageEdge;
  /** The SVG path, from the input's box to the derived thing's box (the arrow's end). */
  d: string;
}

export interface ILineageLayout {
  width: number;
  height: number;
  columns: { title: string; x: number; width: number }[];
  nodes: IPlacedNode[];
  edges: IPlacedEdge[];
  /** Edges left out: an end that is not a node, or a node pointing at itself. */
  dropped: number;
}

function columnOf(kind: string): number {
  const index = LINEAGE_COLUMNS.findIndex(c =>
    (c.kinds as readonly string[]).includes(kind)
  );
  return index >= 0 ? index : LINEAGE_COLUMNS.length;
}

/**
 * Place the nodes in columns by kind and route the edges.
 *
 * Within a column the nodes start in the order the service gave them; a sweep
 * left to right, then one back, sorts each column by the mean row of its
 * neighbours in the other columns (the barycentre heuristic), which keeps
 * edges short and crossings few. Deterministic: the same lineage always draws the same picture.
 */
export function layoutLineage(
  lineage: Pick<ILineage, 'nodes' | 'edges'>,
  options: Partial<ILineageLayoutOptions> = {}
): ILineageLayout {
  const o = { ...DEFAULT_LINEAGE_LAYOUT, ...options };
  const seen = new Set<string>();
  const nodes = (lineage.nodes ?? []).filter(n => {
    if (!n || typeof n.id !== 'string' || seen.has(n.id)) {
      return false;
    }
    seen.add(n.id);
    return true;
  });

  // Columns: the known ones that have nodes, in order, then "Other".
  const byColumn = new Map<number, ILineageNode[]>();
  for (const node of nodes) {
    const c = columnOf(node.kind);
    byColumn.set(c, [...(byColumn.get(c) ?? []), node]);
  }
  const used = [...byColumn.keys()].sort((a, b) => a - b);
  const columns = used.map(c => byColumn.get(c) as ILineageNode[]);

  const edges = (lineage.edges ?? []).filter(
    e => e && seen.has(e.from) && seen.has(e.to) && e.from !== e.to
  );
  const neighbours = new Map<string, string[]>();
  for (const e of edges) {
    neighbours.set(e.from, [...(neighbours.get(e.from) ?? []), e.to]);
    neighbours.set(e.to, [...(neighbours.get(e.to) ?? []), e.from]);
  }

  const rowOf = () => {
    const rows = new Map<string, number>();
    columns.forEach(col => col.forEach((n, i) => rows.set(n.id, i)));
    return rows;
  };
  const reorder = (c: number) => {
    const col = columns[c];
    const rows = rowOf();
    const key = (n: ILineageNode, i: number) => {
      const others = (neighbours.get(n.id) ?? []).filter(
        id => !col.some(m => m.id === id)
      );
      return others.length
        ? others.reduce((sum, id) => sum + (rows.get(id) ?? 0), 0) /
            others.length
        : i;
    };
    columns[c] = col
      .map((n, i) => ({ n, i, k: key(n, i) }))
      .sort((a, b) => a.k - b.k || a.i - b.i)
      .map(entry => entry.n);
  };
  // Down the columns and back: each column follows the order just given to its neighbours.
  for (let c = 1; c < columns.length; c++) {
    reorder(c);
  }
  for (let c = columns.length - 2; c >= 0; c--) {
    reorder(c);
  }

  const tallest = Math.max(0, ...columns.map(col => col.length));
  const inner = tallest ? tallest * (o.nodeHeight + o.rowGap) - o.rowGap : 0;
  const top = o.padding + o.headerHeight;
  const placed: IPlacedNode[] = [];
  const columnBoxes = columns.map((col, c) => {
    const x = o.padding + c * (o.nodeWidth + o.columnGap);
    const height = col.length * (o.nodeHeight + o.rowGap) - o.rowGap;
    const y0 = top + (inner - height) / 2;
    col.forEach((node, row) =>
      placed.push({
        node,
        column: c,
        row,
        x,
        y: y0 + row * (o.nodeHeight + o.rowGap),
        width: o.nodeWidth,
        height: o.nodeHeight
      })
    );
    const index = used[c];
    return {
      title:
        index < LINEAGE_COLUMNS.length
          ? LINEAGE_COLUMNS[index].title
          : OTHER_COLUMN,
      x,
      width: o.nodeWidth
    };
  });

  const byId = new Map(placed.map(p => [p.node.id, p]));
  const round = (v: number) => Math.round(v * 10) / 10;
  const routed = edges.map(edge => {
    const source = byId.get(edge.to) as IPlacedNode; // the input
    const target = byId.get(edge.from) as IPlacedNode; // what was made from it
    const sy = source.y + source.height / 2;
    const ty = target.y + target.height / 2;
    let d: string;
    if (source.column === target.column) {
      // Same column: a loop out of the right side and back.
      const x = source.x + source.width;
      const bulge = o.columnGap / 2;
      d = `M${round(x)},${round(sy)}C${round(x + bulge)},${round(sy)} ${round(x + bulge)},${round(ty)} ${round(x)},${round(ty)}`;
    } else {
      const rightwards = source.column < target.column;
      const x1 = rightwards ? source.x + source.width : source.x;
      const x2 = rightwards ? target.x : target.x + target.width;
      const mid = (x1 + x2) / 2;
      d = `M${round(x1)},${round(sy)}C${round(mid)},${round(sy)} ${round(mid)},${round(ty)} ${round(x2)},${round(ty)}`;
    }
    return { edge, d };
  });

  const count = columns.length;
  return {
    width: count
      ? 2 * o.padding + count * o.nodeWidth + (count - 1) * o.columnGap
      : 2 * o.padding,
    height: top + inner + o.padding,
    columns: columnBoxes,
    nodes: placed,
    edges: routed,
    dropped: (lineage.edges ?? []).length - edges.length
  };
}

/** A link the graph may open: http(s) or a path on this server, never `javascript:` and the like. */
export function safeUrl(url: string | null | undefined): string | null {
  if (typeof url !== 'string' || !url.trim()) {
    return null;
  }
  const text = url.trim();
  const scheme = /^([a-zA-Z][a-zA-Z0-9+.-]*):/.exec(text);
  if (scheme) {
    return /^https?$/i.test(scheme[1]) ? text : null;
  }
  return text.startsWith('//') ? null : text;
}

/** A label cut to fit its box, with an ellipsis. */
export function clip(text: string, max = 26): string {
  const value = String(text ?? '');
  return value.length > max ? `${value.slice(0, max - 1)}…` : value;
}

/** A detail value as text. */
export function formatDetail(value: unknown): string {
  if (value === null || value === undefined) {
    return '—';
  }
  if (typeof value === 'boolean') {
    return value ? 'yes' : 'no';
  }
  if (typeof value === 'number') {
    return Number.isInteger(value) ? String(value) : formatNumber(value);
  }
  if (typeof value === 'string') {
    return value;
  }
  return clip(JSON.stringify(value), 200);
}

let markerCount = 0;

/** The graph and the detail panel of the clicked node. */
export function LineageGraph(props: {
  lineage: ILineage;
  options?: Partial<ILineageLayoutOptions>;
}): JSX.Element {
  const layout = React.useMemo(
    () => layoutLineage(props.lineage, props.options),
    [props.lineage, props.options]
  );
  const [marker] = React.useState(() => `danlu-lineage-arrow-${++markerCount}`);
  const [selected, setSelected] = React.useState<string | null>(null);
  const current = layout.nodes.find(p => p.node.id === selected) ?? null;
  const labelOf = (id: string) =>
    layout.nodes.find(p => p.node.id === id)?.node.label ?? id;
  const select = (id: string) => setSelected(id === selected ? null : id);

  return (
    <div className="danlu-lineage-body">
      <div className="danlu-lineage-canvas">
        <svg
          className="danlu-lineage-graph"
          role="group"
          aria-label={`Lineage graph: ${layout.nodes.length} nodes, ${layout.edges.length} edges`}
          viewBox={`0 0 ${layout.width} ${layout.height}`}
          width={layout.width}
          height={layout.height}
        >
          <defs>
            <marker
              id={marker}
              viewBox="0 0 10 10"
              refX="10"
              refY="5"
              markerWidth="8"
              markerHeight="8"
              orient="auto-start-reverse"
            >
              <path d="M0,0L10,5L0,10z" className="danlu-lineage-arrowhead" />
            </marker>
          </defs>
          {layout.columns.map(c => (
            <text
              key={c.title}
              className="danlu-lineage-column-title"
              x={c.x + c.width / 2}
              y={DEFAULT_LINEAGE_LAYOUT.padding + 12}
              textAnchor="middle"
            >
              {c.title}
            </text>
          ))}
          {layout.edges.map(({ edge, d }) => (
            <path
              key={`${edge.from}>${edge.to}>${edge.relation}`}
              className={`danlu-lineage-edge${
                selected && (edge.from === selected || edge.to === selected)
                  ? ' danlu-mod-active'
                  : ''
              }`}
              data-from={edge.from}
              data-to={edge.to}
              data-relation={edge.relation}
              d={d}
              fill="none"
              markerEnd={`url(#${marker})`}
            >
              <title>{`${labelOf(edge.from)} ${edge.relation.replace(/_/g, ' ')} ${labelOf(edge.to)}`}</title>
            </path>
          ))}
          {layout.nodes.map(p => (
            <g
              key={p.node.id}
              className={`danlu-lineage-node danlu-kind-${p.node.kind}${
                p.node.id === selected ? ' danlu-mod-selected' : ''
              }`}
              data-node-id={p.node.id}
              data-kind={p.node.kind}
              transform={`translate(${p.x},${p.y})`}
              role="button"
              tabIndex={0}
              aria-label={`${kindLabel(p.node.kind)}: ${p.node.label}`}
              aria-pressed={p.node.id === selected}
              onClick={() => select(p.node.id)}
              onKeyDown={event => {
                if (event.key === 'Enter' || event.key === ' ') {
                  event.preventDefault();
                  select(p.node.id);
                }
              }}
            >
              <title>{p.node.label}</title>
              <rect width={p.width} height={p.height} rx={4} ry={4} />
              <text className="danlu-lineage-kind" x={10} y={18}>
                {kindLabel(p.node.kind)}
              </text>
              <text className="danlu-lineage-label" x={10} y={38}>
                {clip(p.node.label)}
              </text>
            </g>
          ))}
        </svg>
        {layout.dropped > 0 && (
          <p className="danlu-form-note">
            {layout.dropped} edge{layout.dropped === 1 ? '' : 's'} left out: an
            end is not in the graph.
          </p>
        )}
      </div>
      <aside
        className="danlu-lineage-detail"
        aria-label="Node details"
        aria-live="polite"
      >
        {current ? (
          <NodeDetail
            node={current.node}
            inputs={layout.edges
              .filter(e => e.edge.from === current.node.id)
              .map(e => ({ id: e.edge.to, relation: e.edge.relation }))}
            outputs={layout.edges
              .filter(e => e.edge.to === current.node.id)
              .map(e => ({ id: e.edge.from, relation: e.edge.relation }))}
            labelOf={labelOf}
            onSelect={setSelected}
          />
        ) : (
          <p className="danlu-empty">Click a box to see its details.</p>
        )}
      </aside>
    </div>
  );
}

function NodeDetail(props: {
  node: ILineageNode;
  inputs: { id: string; relation: string }[];
  outputs: { id: string; relation: string }[];
  labelOf: (id: string) => string;
  onSelect: (id: string) => void;
}): JSX.Element {
  const { node } = props;
  const url = safeUrl(node.url);
  const entries = Object.entries(node.detail ?? {});
  const links = (title: string, list: { id: string; relation: string }[]) =>
    list.length > 0 && (
      <>
        <h4>{title}</h4>
        <ul className="danlu-lineage-links">
          {list.map(l => (
            <li key={`${l.id}-${l.relation}`}>
              <button
                type="button"
                className="jp-Button jp-mod-minimal danlu-lineage-goto"
                onClick={() => props.onSelect(l.id)}
              >
                {props.labelOf(l.id)}
              </button>{' '}
              <span className="danlu-lineage-relation">
                ({l.relation.replace(/_/g, ' ')})
              </span>
            </li>
          ))}
        </ul>
      </>
    );
  return (
    <div className="danlu-lineage-node-detail" data-node-id={node.id}>
      <h3>{node.label}</h3>
      <p className="danlu-lineage-detail-kind">{kindLabel(node.kind)}</p>
      {entries.length > 0 && (
        <dl>
          {entries.map(([key, value]) => (
            <React.Fragment key={key}>
              <dt>{key}</dt>
              <dd>{formatDetail(value)}</dd>
            </React.Fragment>
          ))}
        </dl>
      )}
      {url && (
        <a
          className="danlu-link"
          href={url}
          target="_blank"
          rel="noopener noreferrer"
        >
          Open {kindLabel(node.kind)}
        </a>
      )}
      {links('Made from', props.inputs)}
      {links('Used by', props.outputs)}
    </div>
  );
}

/** What the view asks of the service (a `DanluService`, or a fake in tests). */
export interface ILineageSource {
  lineage(name: string, version: string | number): Promise<ILineage>;
}

type ViewState =
  | { status: 'loading' }
  | { status: 'error'; error: string }
  | { status: 'ready'; lineage: ILineage };

/** Loads the lineage of one model version and draws it, with Refresh and the error's Retry. */
export function LineageView(props: {
  source: ILineageSource;
  name: string;
  version: string;
}): JSX.Element {
  const { source, name, version } = props;
  const [state, setState] = React.useState<ViewState>({ status: 'loading' });
  const generation = React.useRef(0);
  const load = React.useCallback(async () => {
    const mine = ++generation.current;
    setState({ status: 'loading' });
    try {
      const lineage = await source.lineage(name, version);
      if (mine === generation.current) {
        setState({ status: 'ready', lineage });
      }
    } catch (error) {
      if (mine === generation.current) {
        setState({
          status: 'error',
          error: error instanceof Error ? error.message : String(error)
        });
      }
    }
  }, [source, name, version]);
  React.useEffect(() => {
    void load();
  }, [load]);

  const model = state.status === 'ready' ? state.lineage.model : null;
  const aliases = model?.aliases
    ? Array.isArray(model.aliases)
      ? model.aliases
      : Object.keys(model.aliases)
    : [];
  return (
    <div className="danlu-lineage" data-model={name} data-version={version}>
      <div className="danlu-section-head">
        <h2>
          Lineage of {name} version {version}
        </h2>
        {model && (
          <span
            className={`danlu-approval danlu-approval-${model.approval}`}
            data-approval={model.approval}
          >
            {model.approval}
          </span>
        )}
        {aliases.map(a => (
          <span key={a} className="danlu-alias">
            @{a}
          </span>
        ))}
        <IconButton
          icon={refreshIcon}
          label="Refresh lineage"
          onClick={() => void load()}
        />
      </div>
      {state.status === 'loading' && <Loading what="the lineage" />}
      {state.status === 'error' && (
        <ErrorState
          message={`Could not load the lineage: ${state.error}`}
          onRetry={() => void load()}
        />
      )}
      {state.status === 'ready' && <LineageGraph lineage={state.lineage} />}
    </div>
  );
}

/** The widget id of a lineage tab: one per model version (the version, digits, ends it). */
export function lineageWidgetId(
  name: string,
  version: string | number
): string {
  return `danlu-lineage-${name}-v${version}`;
}

/** A main-area tab with the lineage of one model version. */
export function createLineageWidget(
  source: ILineageSource,
  name: string,
  version: string | number
): MainAreaWidget<ReactWidget> {
  const content = ReactWidget.create(
    <LineageView source={source} name={name} version={String(version)} />
  );
  content.addClass('danlu-lineage-panel');
  const widget = new MainAreaWidget({ content });
  widget.id = lineageWidgetId(name, version);
  widget.title.label = `Lineage: ${name} v${version}`;
  widget.title.caption = `What made model ${name} version ${version}`;
  widget.title.icon = danluIcon;
  widget.title.closable = true;
  return widget;
}
