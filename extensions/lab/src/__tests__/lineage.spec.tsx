/**
 * The lineage view: the pure layout (columns by kind, rows, edge routes) and
 * the rendered graph over a fixture of GET lineage/models/{name}/{version}:
 * boxes, arrows, the detail panel and its links, the loading and error states.
 */
import { ReactWidget } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import * as React from 'react';

import {
  KIND_LABELS,
  LINEAGE_COLUMNS,
  LineageGraph,
  LineageView,
  OTHER_COLUMN,
  createLineageWidget,
  layoutLineage,
  lineageWidgetId,
  safeUrl
} from '../components/lineage';
import { ILineage } from '../tokens';
import FIXTURE from './lineage-fixture.json';

const LINEAGE = FIXTURE as unknown as ILineage; // the JSON as the service sends it

function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

async function until<T>(
  find: () => T | null | undefined | false,
  timeout = 3000
): Promise<T> {
  const start = Date.now();
  for (;;) {
    const found = find();
    if (found) {
      return found;
    }
    if (Date.now() - start > timeout) {
      throw new Error('not rendered in time');
    }
    await sleep(5);
  }
}

/** The start and end points of an edge's path `Mx1,y1C... x2,y2`. */
function ends(d: string): { x1: number; y1: number; x2: number; y2: number } {
  const numbers = d.match(/-?\d+(\.\d+)?/g)!.map(Number);
  return {
    x1: numbers[0],
    y1: numbers[1],
    x2: numbers[numbers.length - 2],
    y2: numbers[numbers.length - 1]
  };
}

describe('layoutLineage', () => {
  const layout = layoutLineage(LINEAGE);
  const placed = (id: string) => layout.nodes.find(p => p.node.id === id)!;

  it('puts every kind in exactly one column, each with a name', () => {
    const kinds = LINEAGE_COLUMNS.flatMap(c => c.kinds);
    expect([...kinds].sort()).toEqual(Object.keys(KIND_LABELS).sort());
    expect(new Set(kinds).size).toBe(kinds.length);
  });

  it('draws the columns from the inputs to the approvals', () => {
    expect(layout.columns.map(c => c.title)).toEqual([
      'Data and environment',
      'Notebook and cell',
      'Job',
      'Run',
      'Evaluation',
      'Model version',
      'Approval'
    ]);
    const xs = layout.columns.map(c => c.x);
    expect(xs).toEqual([...xs].sort((a, b) => a - b));
    expect(placed('dataset_version:mnist/3').x).toBe(layout.columns[0].x);
    expect(placed('environment:python').x).toBe(layout.columns[0].x);
    expect(placed('cell:ab12').x).toBe(layout.columns[1].x);
    expect(placed('job:0123456789ab').x).toBe(layout.columns[2].x);
    expect(placed('approval:1').x).toBe(layout.columns[6].x);
    expect(layout.nodes).toHaveLength(LINEAGE.nodes.length);
    expect(layout.edges).toHaveLength(LINEAGE.edges.length);
    expect(layout.dropped).toBe(0);
  });

  it('keeps every box inside the picture and apart from the others in its column', () => {
    for (const p of layout.nodes) {
      expect(p.x).toBeGreaterThanOrEqual(0);
      expect(p.y).toBeGreaterThanOrEqual(0);
      expect(p.x + p.width).toBeLessThanOrEqual(layout.width);
      expect(p.y + p.height).toBeLessThanOrEqual(layout.height);
    }
    const data = layout.nodes
      .filter(p => p.column === 0)
      .sort((a, b) => a.y - b.y);
    expect(data).toHaveLength(3);
    for (let i = 1; i < data.length; i++) {
      expect(data[i].y).toBeGreaterThanOrEqual(
        data[i - 1].y + data[i - 1].height
      );
    }
  });

  it('routes each arrow from the input to what was made from it', () => {
    const edge = layout.edges.find(
      e => e.edge.to === 'dataset_version:mnist/3'
    )!;
    const data = placed('dataset_version:mnist/3');
    const job = placed('job:0123456789ab');
    expect(ends(edge.d)).toEqual({
      x1: data.x + data.width,
      y1: data.y + data.height / 2,
      x2: job.x,
      y2: job.y + job.height / 2
    });
    // approval -> model_version: the model version (left) flows into its approval (right)
    const decides = layout.edges.find(e => e.edge.relation === 'decides')!;
    const mv = placed('model_version:mnist-classifier/1');
    expect(ends(decides.d).x1).toBe(mv.x + mv.width);
    expect(ends(decides.d).x2).toBe(placed('approval:1').x);
    // evaluation -> model_version: the arrow runs leftwards, into the evaluation's right side
    const evaluated = layout.edges.find(e => e.edge.relation === 'evaluated')!;
    const evaluation = placed('evaluation:1');
    expect(ends(evaluated.d).x1).toBe(mv.x);
    expect(ends(evaluated.d).x2).toBe(evaluation.x + evaluation.width);
  });

  it('orders a column by its neighbours so that edges do not cross', () => {
    const crossed = layoutLineage({
      nodes: [
        { id: 'd1', kind: 'dataset_version', label: 'd1' },
        { id: 'd2', kind: 'dataset_version', label: 'd2' },
        { id: 'j1', kind: 'job', label: 'j1' },
        { id: 'j2', kind: 'job', label: 'j2' }
      ],
      edges: [
        { from: 'j1', to: 'd2', relation: 'read' },
        { from: 'j2', to: 'd1', relation: 'read' }
      ]
    });
    const row = (id: string) => crossed.nodes.find(p => p.node.id === id)!.row;
    expect(row('d2') < row('d1')).toBe(row('j1') < row('j2'));
  });

  it('is the same picture every time', () => {
    expect(layoutLineage(LINEAGE)).toEqual(layout);
  });

  it('puts kinds it does not know last, and leaves out edges to nowhere', () => {
    const odd = layoutLineage({
      nodes: [
        { id: 'a', kind: 'job', label: 'a' },
        { id: 'a', kind: 'run', label: 'duplicate id' },
        { id: 'x', kind: 'feature_store', label: 'x' },
        { id: 'r', kind: 'run', label: 'r' }
      ],
      edges: [
        { from: 'r', to: 'a', relation: 'tracks' },
        { from: 'a', to: 'x', relation: 'read' },
        { from: 'a', to: 'missing', relation: 'read' },
        { from: 'r', to: 'r', relation: 'self' }
      ]
    });
    expect(odd.columns.map(c => c.title)).toEqual(['Job', 'Run', OTHER_COLUMN]);
    expect(odd.nodes.map(p => p.node.label)).toEqual(['a', 'r', 'x']);
    expect(odd.edges.map(e => e.edge.relation)).toEqual(['tracks', 'read']);
    expect(odd.dropped).toBe(2);
  });

  it('draws nothing for an empty lineage', () => {
    const empty = layoutLineage({ nodes: [], edges: [] });
    expect(empty.nodes).toEqual([]);
    expect(empty.columns).toEqual([]);
    expect(empty.width).toBeGreaterThan(0);
  });
});

describe('safeUrl', () => {
  it('keeps http(s) and paths, refuses other schemes', () => {
    expect(safeUrl('/services/mlflow/#/runs/1')).toBe(
      '/services/mlflow/#/runs/1'
    );
    expect(safeUrl('https://mlflow.example.org/x')).toBe(
      'https://mlflow.example.org/x'
    );
    expect(safeUrl('javascript:alert(1)')).toBeNull();
    expect(safeUrl(' JavaScript:alert(1)')).toBeNull();
    expect(safeUrl('data:text/html,hi')).toBeNull();
    expect(safeUrl('//evil.example.org/')).toBeNull();
    expect(safeUrl(null)).toBeNull();
    expect(safeUrl('')).toBeNull();
  });
});

describe('LineageGraph', () => {
  let widget: Widget | null = null;
  afterEach(() => {
    widget?.dispose();
    widget = null;
  });

  function render(element: JSX.Element): HTMLElement {
    widget = ReactWidget.create(element);
    Widget.attach(widget, document.body);
    return widget.node;
  }

  it('draws a box per node with its kind and label, and an arrow per edge', async () => {
    const node = render(<LineageGraph lineage={LINEAGE} />);
    const svg = await until(() =>
      node.querySelector('svg.danlu-lineage-graph')
    );
    const boxes = svg.querySelectorAll('g.danlu-lineage-node');
    expect(boxes).toHaveLength(10);
    const job = svg.querySelector('g[data-node-id="job:0123456789ab"]')!;
    expect(job.getAttribute('data-kind')).toBe('job');
    expect(job.getAttribute('role')).toBe('button');
    expect(job.getAttribute('aria-label')).toBe('job: job 0123456789ab');
    expect(job.querySelector('.danlu-lineage-kind')!.textContent).toBe('job');
    expect(job.querySelector('.danlu-lineage-label')!.textContent).toBe(
      'job 0123456789ab'
    );
    // a long label is clipped in the box, whole in its tooltip
    const cell = svg.querySelector('g[data-kind=cell]')!;
    expect(cell.querySelector('title')!.textContent).toBe(
      'cell sha256 ab12cd34'
    );

    const edges = svg.querySelectorAll('path.danlu-lineage-edge');
    expect(edges).toHaveLength(9);
    const marker = svg.querySelector('marker')!.id;
    for (const edge of edges) {
      expect(edge.getAttribute('marker-end')).toBe(`url(#${marker})`);
    }
    const read = svg.querySelector(
      'path[data-from="job:0123456789ab"][data-to="dataset_version:mnist/3"]'
    )!;
    expect(read.querySelector('title')!.textContent).toBe(
      'job 0123456789ab read mnist@3'
    );
    expect(
      [...svg.querySelectorAll('.danlu-lineage-column-title')].map(
        t => t.textContent
      )
    ).toContain('Data and environment');
  });

  it("shows a node's details, its link in a new tab and its neighbours on click", async () => {
    const node = render(<LineageGraph lineage={LINEAGE} />);
    const panel = await until(() =>
      node.querySelector('.danlu-lineage-detail')
    );
    expect(panel.textContent).toMatch(/Click a box/);
    const run = node.querySelector('g[data-node-id="run:4f1c"]')!;
    run.dispatchEvent(new MouseEvent('click', { bubbles: true }));
    const detail = await until(() =>
      panel.querySelector('.danlu-lineage-node-detail[data-node-id="run:4f1c"]')
    );
    expect(detail.querySelector('h3')!.textContent).toBe('bright-owl-42');
    expect(
      detail.querySelector('.danlu-lineage-detail-kind')!.textContent
    ).toBe('MLflow run');
    const terms = [...detail.querySelectorAll('dt')].map(d => d.textContent);
    const values = [...detail.querySelectorAll('dd')].map(d => d.textContent);
    expect(terms).toEqual(['status', 'seed']);
    expect(values).toEqual(['FINISHED', '1234']);
    const link = detail.querySelector('a')!;
    expect(link.getAttribute('href')).toBe(
      '/services/mlflow/#/experiments/1/runs/4f1c'
    );
    expect(link.getAttribute('target')).toBe('_blank');
    expect(link.getAttribute('rel')).toMatch(/noopener/);
    expect(detail.textContent).toMatch(/Made from.*job 0123456789ab/);
    expect(detail.textContent).toMatch(/Used by.*mnist-classifier v1/);
    expect(run.getAttribute('aria-pressed')).toBe('true');
    expect(run.getAttribute('class')).toMatch(/danlu-mod-selected/);
    const active = node.querySelectorAll(
      'path.danlu-lineage-edge.danlu-mod-active'
    );
    expect(active).toHaveLength(2);

    // a neighbour in the panel selects that node
    const goto = [...detail.querySelectorAll('button')].find(
      b => b.textContent === 'job 0123456789ab'
    )!;
    goto.click();
    const jobDetail = await until(() =>
      panel.querySelector('[data-node-id="job:0123456789ab"]')
    );
    expect(
      [...jobDetail.querySelectorAll('dd')].map(d => d.textContent)
    ).toEqual(['python', '9e1f2a7', 'no', '0.1']);
  });

  it('selects with the keyboard and shows empty values as a dash', async () => {
    const node = render(<LineageGraph lineage={LINEAGE} />);
    const env = await until(() =>
      node.querySelector('g[data-node-id="environment:python"]')
    );
    env.dispatchEvent(
      new KeyboardEvent('keydown', { key: 'Enter', bubbles: true })
    );
    const detail = await until(() =>
      node.querySelector('.danlu-lineage-node-detail')
    );
    expect([...detail.querySelectorAll('dd')].map(d => d.textContent)).toEqual([
      'sha256:9f8e',
      '—'
    ]);
    expect(detail.querySelector('a')).toBeNull(); // no url, no link
  });

  it('never links a javascript: url', async () => {
    const lineage: ILineage = {
      ...LINEAGE,
      nodes: [
        {
          id: 'n',
          kind: 'job',
          label: 'evil',
          detail: {},
          url: 'javascript:alert(1)'
        }
      ],
      edges: []
    };
    const node = render(<LineageGraph lineage={lineage} />);
    const box = await until(() => node.querySelector('g[data-node-id=n]'));
    box.dispatchEvent(new MouseEvent('click', { bubbles: true }));
    const detail = await until(() =>
      node.querySelector('.danlu-lineage-node-detail')
    );
    expect(detail.querySelector('a')).toBeNull();
  });

  it('loads the lineage, shows the approval, and offers Retry on an error', async () => {
    const lineage = jest
      .fn()
      .mockRejectedValueOnce(
        new Error('model mnist-classifier version 1 not found')
      )
      .mockResolvedValue(LINEAGE);
    const node = render(
      <LineageView source={{ lineage }} name="mnist-classifier" version="1" />
    );
    const error = await until(() => node.querySelector('.danlu-error'));
    expect(error.textContent).toMatch(
      /Could not load the lineage: model mnist-classifier version 1 not found/
    );
    expect(lineage).toHaveBeenCalledWith('mnist-classifier', '1');
    [...error.querySelectorAll('button')]
      .find(b => b.textContent === 'Retry')!
      .click();
    await until(() => node.querySelector('svg.danlu-lineage-graph'));
    expect(node.querySelector('h2')!.textContent).toBe(
      'Lineage of mnist-classifier version 1'
    );
    expect(
      node.querySelector('.danlu-approval')!.getAttribute('data-approval')
    ).toBe('approved');
    expect(node.querySelector('.danlu-alias')!.textContent).toBe('@champion');
    expect(lineage).toHaveBeenCalledTimes(2);
  });
});

describe('the lineage tab', () => {
  it('is one tab per model version, named after it', () => {
    const widget = createLineageWidget(
      { lineage: jest.fn(async () => LINEAGE) },
      'mnist.v2',
      3
    );
    expect(widget.id).toBe(lineageWidgetId('mnist.v2', 3));
    expect(widget.id).toBe('danlu-lineage-mnist.v2-v3');
    expect(widget.title.label).toBe('Lineage: mnist.v2 v3');
    expect(widget.title.closable).toBe(true);
    widget.dispose();
  });
});
