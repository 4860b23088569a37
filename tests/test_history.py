"""Pure tests of history at scale, on a SQLite database and no service: the audit chain verified in
batches, and usage rollups that add up to exactly what the raw rows give.

The audit log is checked batch by batch with batches smaller than the log, so every kind of
tampering is also found where it straddles two batches. Usage is generated at random (seeded):
jobs with retries, gaps, zero-length and still running attempts, servers, NVML samples; a report
read from rollups must equal the same report computed from the raw rows alone, whatever the
range, the grouping, the owner and where the watermark stands. Retention deletes only samples
that are rolled up.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random

import pytest
from sqlalchemy import delete, func, insert, select, update

from danlu.errors import ConfigError
from danlu.hub.config import load_settings
from danlu.hub.service.store import audit, schema
from danlu.hub.service.store.orm import Attempt, AuditRecord, GpuSample, Job, ServerUsage, UsageRollup
from danlu.hub.service.usage import reports as usage
from danlu.hub.service.usage import rollups


@pytest.fixture
def sessions(tmp_path):
    audit.use_key(audit.load_key(tmp_path))
    return schema.prepare(f"sqlite:///{tmp_path / 'danlu.sqlite'}")


# the audit chain ------------------------------------------------------------------------------------
def chain(sessions, n: int) -> None:
    with sessions() as s, s.begin():
        for i in range(n):
            audit.append(s, f"user{i % 3}", "submit", f"{i:012x}", after={"i": i})


def unkeyed(prev_hash: str, record: AuditRecord) -> str:
    """A record's hash as Mallory computes it: SHA-256 of the previous hash and the record's canonical JSON
    (the chain as it was before it was keyed; the format is in the source, anyone can read it)."""
    body = {
        "seq": record.seq,
        "at": record.at.isoformat() + "Z",
        "actor": record.actor,
        "action": record.action,
        "target": record.target,
        "before": record.before,
        "after": record.after,
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{prev_hash}\n{text}".encode()).hexdigest()


def test_a_rewrite_by_whoever_holds_only_the_database_is_found(sessions, tmp_path):
    """Mallory can write the database, not the state folder's audit.key: she edits record 5 and recomputes
    its hash and every one after it, as the chain was computed before it was keyed."""
    chain(sessions, 8)
    with sessions() as s, s.begin():
        s.get(AuditRecord, 5).actor = "mallory"
        prev = s.get(AuditRecord, 4).hash
        for record in s.scalars(select(AuditRecord).where(AuditRecord.seq >= 5).order_by(AuditRecord.seq)):
            record.prev_hash, record.hash = prev, unkeyed(prev, record)
            prev = record.hash
    with sessions() as s:
        found = audit.verify(s)

    assert found.to_dict() == {"ok": False, "records": 5, "problem": "record 5 was altered", "seq": 5}
    assert (tmp_path / audit.KEY_FILE).stat().st_mode & 0o777 == 0o600


def test_an_audit_key_others_can_read_is_refused(tmp_path):
    audit.load_key(tmp_path)
    (tmp_path / audit.KEY_FILE).chmod(0o644)
    with pytest.raises(ConfigError, match="may be read or changed by other accounts") as e:
        audit.load_key(tmp_path)
    assert e.value.fix.startswith(f"chmod 600 {tmp_path / audit.KEY_FILE}")


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 100])
def test_verification_in_batches_finds_what_a_whole_read_finds(sessions, batch):
    chain(sessions, 20)
    with sessions() as s:
        assert audit.verify(s, batch=batch).to_dict() == {"ok": True, "records": 20, "problem": "", "seq": None}
    for seq in (1, 3, 4, 20):  # altered, at and around batch edges
        with sessions() as s, s.begin():
            original = s.get(AuditRecord, seq).actor
            s.get(AuditRecord, seq).actor = "mallory"
        with sessions() as s:
            assert audit.verify(s, batch=batch).to_dict() == {
                "ok": False,
                "records": seq,
                "problem": f"record {seq} was altered",
                "seq": seq,
            }
        with sessions() as s, s.begin():
            s.get(AuditRecord, seq).actor = original
    with sessions() as s, s.begin():
        s.delete(s.get(AuditRecord, 7))
    with sessions() as s:
        assert audit.verify(s, batch=batch).to_dict() == {
            "ok": False,
            "records": 7,
            "problem": "record 7 is missing (next is 8)",
            "seq": 7,
        }


def test_a_gap_longer_than_a_batch_names_the_record_the_log_resumes_at(sessions):
    chain(sessions, 12)
    with sessions() as s, s.begin():
        s.execute(delete(AuditRecord).where(AuditRecord.seq.between(3, 9)))
    with sessions() as s:
        answers = {batch: audit.verify(s, batch=batch).to_dict() for batch in (2, 3, 5, 100)}
    assert all(
        a == {"ok": False, "records": 3, "problem": "record 3 is missing (next is 10)", "seq": 3}
        for a in answers.values()
    ), answers


def test_a_spliced_record_breaks_the_chain_in_any_batch(sessions):
    chain(sessions, 9)
    with sessions() as s, s.begin():
        s.execute(update(AuditRecord).where(AuditRecord.seq == 5).values(prev_hash="f" * 64))
    with sessions() as s:
        for batch in (1, 4, 5, 50):
            assert audit.verify(s, batch=batch).problem == "record 5 does not follow record 4"


# usage rollups -------------------------------------------------------------------------------------
T0 = dt.datetime(2026, 11, 2, 0, 0, 0)
SPAN = dt.timedelta(days=3)
NOW = T0 + SPAN + dt.timedelta(minutes=17, seconds=3)
OWNERS = ("alice", "bob", "carol")


def at(rng: random.Random, lo: dt.datetime, hi: dt.datetime) -> dt.datetime:
    """A whole second in [lo, hi], often on an hour boundary (the edges are where rollups can go wrong)."""
    t = lo + dt.timedelta(seconds=rng.randrange(int((hi - lo).total_seconds()) + 1))
    return t.replace(minute=0, second=0) if rng.random() < 0.15 and t.replace(minute=0, second=0) >= lo else t


def fill(sessions, seed: int) -> dict:
    """Random history: jobs with 1-3 attempts (gaps between, some of no length, the last ones still
    running), servers, samples of four devices; whole seconds and whole-number utilization, so every
    sum is exact in floating point whatever its order. Returns what a brute-force count needs."""
    rng = random.Random(seed)
    jobs, attempts, servers, samples = [], [], [], []
    for i in range(70):
        job_id = f"{seed:04x}{i:08x}"
        owner, queue, profile = rng.choice(OWNERS), rng.choice(("vision", "nlp")), rng.choice(("python", "torch"))
        jobs.append(
            {
                "id": job_id,
                "owner": owner,
                "name": f"j{i}",
                "state": "succeeded",
                "profile": profile,
                "queue": queue,
                "created_at": T0,
            }
        )
        t = at(rng, T0, T0 + SPAN)
        for number in range(1, rng.choice((1, 1, 2, 3)) + 1):
            length = rng.choice((0, 60, 1800, 3600, 4 * 3600, 30 * 3600, rng.randrange(1, 50_000)))
            finish = t + dt.timedelta(seconds=length)
            if finish > NOW or (i >= 66 and number == 1):
                finish = None
            gpus = rng.choice((0, 0, 1, 2))
            devices = rng.sample(range(4), gpus)
            attempts.append(
                {
                    "job_id": job_id,
                    "number": number,
                    "state": "succeeded",
                    "devices": devices,
                    "flavor": ("a" if devices[0] < 2 else "b") if devices else None,
                    "started_at": t,
                    "finished_at": finish,
                }
            )
            if finish is None:
                break
            t = finish + dt.timedelta(seconds=rng.choice((0, 10, 3600 * 5, rng.randrange(1, 20_000))))
            if t > NOW:
                break
    for i in range(12):
        begin = at(rng, T0 - dt.timedelta(hours=5), T0 + SPAN)
        end = begin + dt.timedelta(seconds=rng.randrange(0, 40_000))
        servers.append(
            {
                "holder": rng.choice(OWNERS),
                "owner": rng.choice(OWNERS),
                "team": "vision",
                "profile": "python",
                "flavor": "a",
                "devices": [rng.randrange(2)],
                "started_at": begin,
                "ended_at": None if end > NOW or i == 0 else end,
            }
        )
    t = T0 - dt.timedelta(hours=2)
    while t < NOW:
        samples += [{"device": d, "at": t, "utilization": float(rng.randrange(101))} for d in range(4)]
        t += dt.timedelta(seconds=rng.choice((600, 601, 1200)))
    with sessions() as s, s.begin():
        for table, rows in ((Job, jobs), (Attempt, attempts), (ServerUsage, servers), (GpuSample, samples)):
            s.execute(insert(table), rows)
    return {"jobs": {j["id"]: j for j in jobs}, "attempts": attempts, "servers": servers, "samples": samples}


def settings_for(tmp_path):
    return load_settings(
        None,
        {"state_dir": str(tmp_path), "usage": {"gpu_hour_cost": {"a": 2.5, "b": 1.25}, "currency": "EUR"}},
        environ={},
    )


def report(sessions, settings, start, end, by="user", owner=None) -> dict:
    with sessions() as s:
        return usage.report(s, settings, start, end, by=by, owner=owner, now=NOW)


def roll_up_to(sessions, when: dt.datetime) -> None:
    """Every pass the service would have run by ``when``."""
    while True:
        with sessions() as s, s.begin():
            if not rollups.roll_up(s, when):
                return


def brute_force(data: dict, start, end, by: str, owner=None) -> dict:
    """The report's numbers straight from the definitions, with none of the service's code."""

    def key(row_owner, team, profile):
        return {"user": row_owner, "team": team, "queue": team, "profile": profile}[by]

    def active(begin, finish):
        return begin < end and (finish is None or finish > start or begin >= start)

    rows: dict = {}
    holdings = [
        ("job", a["job_id"], data["jobs"][a["job_id"]], a["devices"], a["started_at"], a["finished_at"])
        for a in data["attempts"]
    ]
    holdings += [
        (
            "server",
            str(i),
            {"owner": s["owner"], "queue": s["team"], "profile": s["profile"]},
            s["devices"],
            s["started_at"],
            s["ended_at"],
        )
        for i, s in enumerate(data["servers"])
    ]
    for kind, holder, row, devices, begin, finish in holdings:
        if (owner is not None and row["owner"] != owner) or not active(begin, finish):
            continue
        r = rows.setdefault(
            key(row["owner"], row["queue"], row["profile"]),
            {"seconds": 0, "job": set(), "server": set(), "util": [0, 0]},
        )
        r[kind].add(holder)
        u, v = max(start, begin), min(end, finish or NOW)
        if v > u:
            r["seconds"] += len(devices) * (v - u).total_seconds()
        for sample in data["samples"]:
            if sample["device"] in devices and u <= sample["at"] < v:
                r["util"][0] += sample["utilization"]
                r["util"][1] += 1
        # busy: hour by hour, each device's seconds held times its samples' mean in that part of the hour
        hour = rollups.floor_hour(u)
        while hour < v:
            a, b = max(u, hour), min(v, hour + HOURS)
            for device in devices:
                found = [x["utilization"] for x in data["samples"] if x["device"] == device and a <= x["at"] < b]
                if found:
                    r["busy"] = r.get("busy", 0) + round((b - a).total_seconds() * sum(found) / len(found) / 100)
            hour += HOURS
    return {
        k: {
            "gpu_hours": round(r["seconds"] / 3600, 4),
            "jobs": len(r["job"]),
            "servers": len(r["server"]),
            "measured_utilization": round(r["util"][0] / r["util"][1], 1) if r["util"][1] else None,
            "gpu_hours_busy": round(r["busy"] / 3600, 4) if "busy" in r else None,
        }
        for k, r in rows.items()
    }


def numbers(answer: dict) -> dict:
    by = answer["by"]
    keys = ("gpu_hours", "jobs", "servers", "measured_utilization", "gpu_hours_busy")
    return {r[by]: {k: r[k] for k in keys} for r in answer["rows"]}


HOURS = dt.timedelta(hours=1)
#: whole hours (partly or wholly rolled up, a day or not, a single hour, beyond the data on both sides)
RANGES = [
    (T0, T0 + SPAN),
    (T0 + 5 * HOURS, T0 + 51 * HOURS),
    (T0 - 24 * HOURS, NOW + HOURS),
    (T0 + 23 * HOURS, T0 + 24 * HOURS),
    (T0 + 24 * HOURS, T0 + 48 * HOURS),
]


@pytest.mark.parametrize("seed", [1, 2, 3, 7, 8])
def test_rolled_up_reports_equal_the_raw_rows_for_any_range_grouping_owner_and_watermark(sessions, tmp_path, seed):
    data = fill(sessions, seed)
    settings = settings_for(tmp_path)
    cases = [
        (start, end, by, owner)
        for start, end in RANGES
        for by in ("user", "team", "profile")
        for owner in (None, "alice")
    ]
    raw = {case: report(sessions, settings, *case) for case in cases}
    for start, end, by, owner in cases:
        assert numbers(raw[(start, end, by, owner)]) == brute_force(data, start, end, by, owner), (start, end, by)
    for watermark in (T0 + dt.timedelta(hours=30, minutes=6), NOW):  # part of the range rolled up, then all
        roll_up_to(sessions, watermark)
        with sessions() as s:
            assert rollups.watermark(s) == rollups.floor_hour(watermark - rollups.GRACE)
        for case in cases:
            assert report(sessions, settings, *case) == raw[case], (watermark, case)


def test_a_range_inside_rolled_up_hours_is_widened_to_whole_hours(sessions, tmp_path):
    data = fill(sessions, 4)
    settings = settings_for(tmp_path)
    roll_up_to(sessions, NOW)
    start, end = T0 + dt.timedelta(hours=3, minutes=20), T0 + dt.timedelta(hours=40, seconds=1)
    answer = report(sessions, settings, start, end)
    assert (answer["from"], answer["to"]) == ("2026-11-02T03:00:00Z", "2026-11-03T17:00:00Z")
    whole = (T0 + dt.timedelta(hours=3), T0 + dt.timedelta(hours=41))
    assert numbers(answer) == brute_force(data, *whole, "user")
    recent = report(sessions, settings, NOW - dt.timedelta(minutes=10), NOW)  # after the watermark: as asked
    assert (recent["from"], recent["to"]) == ("2026-11-05T00:07:03Z", "2026-11-05T00:17:03Z")
    assert numbers(recent) == brute_force(data, NOW - dt.timedelta(minutes=10), NOW, "user")


def test_a_pass_rolls_up_each_hour_once_and_days_are_the_sums_of_their_hours(sessions, tmp_path):
    fill(sessions, 5)
    roll_up_to(sessions, NOW)
    with sessions() as s:
        rows = s.scalar(select(func.count()).select_from(UsageRollup))
        hours = s.execute(
            select(
                func.sum(UsageRollup.gpu_seconds), func.sum(UsageRollup.util_n), func.sum(UsageRollup.started)
            ).where(UsageRollup.span == "hour", UsageRollup.bucket >= T0, UsageRollup.bucket < T0 + SPAN)
        ).one()
        days = s.execute(
            select(
                func.sum(UsageRollup.gpu_seconds), func.sum(UsageRollup.util_n), func.sum(UsageRollup.started)
            ).where(UsageRollup.span == "day", UsageRollup.bucket >= T0, UsageRollup.bucket < T0 + SPAN)
        ).one()
        assert tuple(hours) == tuple(days) and hours[0] > 0
        assert s.scalar(select(func.count()).where(UsageRollup.span == "day", UsageRollup.active.is_not(None))) == 0
    with sessions() as s, s.begin():
        assert rollups.roll_up(s, NOW) is False
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(UsageRollup)) == rows


def test_retention_deletes_only_samples_rolled_up_and_reports_do_not_change(sessions, tmp_path):
    fill(sessions, 6)
    settings = settings_for(tmp_path)
    midway = T0 + dt.timedelta(days=1, hours=12)
    roll_up_to(sessions, midway)
    with sessions() as s, s.begin():
        through = rollups.watermark(s)
        while rollups.expire_samples(s, NOW, keep_days=1, batch=50):
            pass
    with sessions() as s:  # a day is older than the policy keeps, but not rolled up yet: kept
        assert s.scalar(select(func.min(GpuSample.at))) >= through
    roll_up_to(sessions, NOW)
    before = report(sessions, settings, T0, T0 + SPAN, by="team")
    with sessions() as s, s.begin():
        gone = rollups.expire_samples(s, NOW, keep_days=1)
    with sessions() as s:
        left = s.scalar(select(func.min(GpuSample.at)))
    assert gone > 0 and left >= NOW - dt.timedelta(days=1)
    assert report(sessions, settings, T0, T0 + SPAN, by="team") == before


def test_a_cached_rolled_up_part_gives_the_same_report_and_is_reused(sessions, tmp_path):
    fill(sessions, 9)
    settings = settings_for(tmp_path)
    roll_up_to(sessions, T0 + dt.timedelta(days=2))
    cache = usage.Cache(size=2)
    with sessions() as s:
        plain = [usage.report(s, settings, T0, end, by="team", now=NOW) for end in (T0 + SPAN, NOW)]
        first = [usage.report(s, settings, T0, end, by="team", now=NOW, cache=cache) for end in (T0 + SPAN, NOW)]
        again = [usage.report(s, settings, T0, end, by="team", now=NOW, cache=cache) for end in (T0 + SPAN, NOW)]
    assert first == plain == again
    assert len(cache._entries) == 1  # both ranges share their rolled-up part
    with sessions() as s:
        for day in range(3):  # more keys than it holds: the oldest go
            usage.report(s, settings, T0 + dt.timedelta(hours=day), NOW, now=NOW, cache=cache)
    assert len(cache._entries) == 2


def test_danlu_usage_prints_busy_beside_allocated_and_na_where_nothing_was_sampled(monkeypatch, capsys):
    from danlu import cli, cliclient

    rows = [
        {
            "team": "vision",
            "gpu_hours": 41.5,
            "gpu_hours_busy": 17.02,
            "cost": 0,
            "jobs": 3,
            "servers": 1,
            "measured_utilization": 41.0,
        },
        {
            "team": "nlp",
            "gpu_hours": 12.25,
            "gpu_hours_busy": None,
            "cost": 0,
            "jobs": 1,
            "servers": 0,
            "measured_utilization": None,
        },
    ]
    answer = {
        "from": "2026-11-01T00:00:00Z",
        "to": "2026-11-30T00:00:00Z",
        "by": "team",
        "currency": "",
        "rows": rows,
        "total": {"gpu_hours": 53.75, "cost": 0, "gpu_hours_busy": 17.02},
    }

    class Client:
        def usage(self, **kwargs):
            return answer

    monkeypatch.setattr(cliclient, "client", lambda args: Client())
    assert cli.main(["usage", "--by", "team"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["team", "GPU-hours", "busy"]
    assert out[2].split()[:3] == ["vision", "41.50", "17.02"] and out[3].split()[:3] == ["nlp", "12.25", "n/a"]
    assert out[4].split()[:3] == ["total", "53.75", "17.02"]
