"""Every route of the jobs service in one list: which handler answers which path."""

from __future__ import annotations

from danlu.hub.service.api import admin, catalog, jobs, pages, runner, sweeps


def routes(prefix: str) -> list:
    base = prefix.rstrip("/")
    api = f"{base}/api/v1"
    job = r"/jobs/(?P<job_id>[^/]+)"
    attempt = f"{api}/runner/jobs/(?P<job_id>[^/]+)/attempts/(?P<attempt>[^/]+)"
    return [
        (f"{base}/?", pages.JobsPageHandler),
        (f"{api}/health", jobs.HealthHandler),
        (f"{api}/openapi.json", jobs.OpenAPIHandler),
        (f"{api}/profiles", jobs.ProfilesHandler),
        (f"{api}/jobs", jobs.JobsHandler),
        (f"{api}/experiments", jobs.ExperimentsHandler),
        (f"{api}{job}", jobs.JobHandler),
        (f"{api}{job}/cancel", jobs.CancelHandler),
        (f"{api}{job}/logs", jobs.LogsHandler),
        (f"{api}{job}/(?P<which>output|input)", jobs.NotebookHandler),
        (f"{api}/queues", jobs.QueuesHandler),
        (f"{api}/usage", jobs.UsageHandler),
        (f"{api}/servers/warnings", jobs.ServerWarningsHandler),
        (f"{api}/datasets", catalog.DatasetsHandler),
        (f"{api}/datasets/(?P<name>[^/]+)", catalog.DatasetHandler),
        (f"{api}/datasets/(?P<name>[^/]+)/versions/(?P<version>[^/]+)", catalog.DatasetVersionHandler),
        (f"{api}{job}/reproduce", jobs.ReproduceHandler),
        (f"{api}{job}/compare/(?P<other>[^/]+)", jobs.CompareHandler),
        (f"{api}{job}/checkpoint", jobs.CheckpointHandler),
        (f"{api}/models", catalog.ModelsHandler),
        (f"{api}/models/(?P<name>[^/]+)", catalog.ModelHandler),
        (f"{api}/models/(?P<name>[^/]+)/versions/(?P<version>[^/]+)", catalog.ModelVersionHandler),
        (f"{api}/models/(?P<name>[^/]+)/versions/(?P<version>[^/]+)/decisions", catalog.ModelDecisionsHandler),
        (f"{api}/models/(?P<name>[^/]+)/versions/(?P<version>[^/]+)/files", catalog.ModelFilesHandler),
        (f"{api}/models/(?P<name>[^/]+)/aliases/(?P<alias>[^/]+)", catalog.ModelAliasHandler),
        (f"{api}/lineage/models/(?P<name>[^/]+)/(?P<version>[^/]+)", catalog.LineageHandler),
        (f"{api}/sweeps", sweeps.SweepsHandler),
        (f"{api}/sweeps/(?P<sweep_id>[^/]+)", sweeps.SweepHandler),
        (f"{api}/sweeps/(?P<sweep_id>[^/]+)/stop", sweeps.SweepStopHandler),
        # admins (and the hub's own token for allocations and logins)
        (f"{api}/allocations", admin.AllocationsHandler),
        (f"{api}/allocations/server/(?P<holder>[^/]+)", admin.ServerAllocationHandler),
        (f"{api}/runners/warm", admin.WarmHandler),
        (f"{api}/queues/(?P<name>[^/]+)", admin.QueueHandler),
        (f"{api}/queues/(?P<name>[^/]+)/(?P<action>hold|release)", admin.QueueHoldHandler),
        (f"{api}/drain", admin.DrainHandler),
        (f"{api}/audit", admin.AuditHandler),
        (f"{api}/audit/verify", admin.AuditVerifyHandler),
        (f"{base}/metrics", admin.MetricsHandler),
        # a job's runner, with its attempt's token
        (f"{attempt}/spec", runner.RunnerSpecHandler),
        (f"{attempt}/stop", runner.RunnerStopHandler),
        (f"{attempt}/events", runner.RunnerEventsHandler),
        (f"{attempt}/outputs/(?P<rank>[^/]+)", runner.RunnerOutputHandler),
        (f"{attempt}/datasets", runner.RunnerDatasetHandler),
    ]
