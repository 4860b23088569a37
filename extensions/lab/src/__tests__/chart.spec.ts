/**
 * The comparison chart's geometry: one path per run inside the plot, round ticks.
 */
import { layoutChart, niceTicks } from '../components/chart';

describe('layoutChart', () => {
  const series = [
    {
      run_id: 'a',
      run_name: 'A',
      points: [
        [2, 0.5],
        [0, 1],
        [1, 0.75]
      ] as [number, number][]
    },
    {
      run_id: 'b',
      run_name: 'B',
      points: [
        [0, 0.9],
        [2, 0.25]
      ] as [number, number][]
    },
    { run_id: 'c', run_name: 'C', points: [] as [number, number][] }
  ];

  it('draws one path per series, sorted by step, inside the plot', () => {
    const layout = layoutChart(series, 320, 200);
    expect(layout.series.map(s => s.run_id)).toEqual(['a', 'b', 'c']);
    const a = layout.series[0].d;
    expect(a.startsWith('M')).toBe(true);
    expect(a.match(/[ML]/g)).toEqual(['M', 'L', 'L']);
    const coords = a
      .split(/[ML]/)
      .filter(Boolean)
      .map(p => p.split(',').map(Number));
    const xs = coords.map(c => c[0]);
    expect(xs).toEqual([...xs].sort((x, y) => x - y));
    for (const [x, y] of coords) {
      expect(x).toBeGreaterThanOrEqual(layout.plot.left);
      expect(x).toBeLessThanOrEqual(layout.plot.right);
      expect(y).toBeGreaterThanOrEqual(layout.plot.top);
      expect(y).toBeLessThanOrEqual(layout.plot.bottom);
    }
    // the highest value is at the top, the lowest at the bottom
    expect(coords[0][1]).toBe(layout.plot.top);
    expect(layout.series[2].d).toBe('');
    expect(layout.series[0].color).not.toBe(layout.series[1].color);
  });

  it('copes with a single point', () => {
    const layout = layoutChart([
      { run_id: 'a', run_name: 'A', points: [[5, 3]] }
    ]);
    expect(layout.series[0].d).toMatch(/^M[\d.]+,[\d.]+$/);
  });
});

describe('niceTicks', () => {
  it('picks round steps within the range', () => {
    expect(niceTicks(0, 1)).toEqual([0, 0.2, 0.4, 0.6, 0.8, 1]);
    expect(niceTicks(0, 100, 4)).toEqual([0, 25, 50, 75, 100]);
    expect(niceTicks(3, 3)).toEqual([3]);
  });
});
