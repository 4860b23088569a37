import { formatCheckpoint } from '../components/format';

describe('formatCheckpoint', () => {
  const saved = { step: 1500, age_seconds: 40, attempt: 2 };

  it('says the step and how long ago, aged since the last poll', () => {
    expect(formatCheckpoint(saved)).toBe('checkpoint step 1500, 40s ago');
    expect(formatCheckpoint(saved, 35)).toBe(
      'checkpoint step 1500, 1m 15s ago'
    );
  });

  it('says its age at the end for a job that ended, and nothing without one', () => {
    expect(formatCheckpoint(saved, 0, true)).toBe(
      'checkpoint step 1500, 40s before the end'
    );
    expect(formatCheckpoint(null)).toBe('');
    expect(formatCheckpoint(undefined)).toBe('');
  });
});
