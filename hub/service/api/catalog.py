"""HTTP handlers of the catalog: datasets and their versions, registered models, their decisions, aliases and
lineage.

Each handler checks its path parameters against their formats (a 400 that names the parameter) and makes one
call of the manager's facades, :attr:`~danlu.hub.service.manager.JobManager.datasets` and
:attr:`~danlu.hub.service.manager.JobManager.models`, which decide who may see and change what.
"""

from __future__ import annotations

import asyncio
import os

from tornado.iostream import StreamClosedError

from danlu.hub.service.api.web import APIHandler
from danlu.hub.service.formats import ALIAS, DATASET, DATASET_VERSION, MODEL, MODEL_FILE_PATH, MODEL_VERSION

#: bytes of a stored model file read and sent at a time
CHUNK = 1 << 20


class DatasetsHandler(APIHandler):
    async def get(self):
        self.write_json({"datasets": await self.manager.datasets.list(self.principal())})

    async def post(self):
        who = self.principal()
        status, body = await self.manager.datasets.register(who, self.json_body())
        self.write_json(body, status)


class DatasetHandler(APIHandler):
    def name_arg(self, value: str) -> str:
        return self.path_arg(value, "name", DATASET, "a dataset name")

    async def get(self, name):
        self.write_json(await self.manager.datasets.show(self.principal(), self.name_arg(name)))


class DatasetVersionHandler(DatasetHandler):
    async def get(self, name, version):
        who = self.principal()
        name = self.name_arg(name)
        number = int(self.path_arg(version, "version", DATASET_VERSION, "a version number (1, 2, ...)"))
        self.write_json(await self.manager.datasets.version(who, name, number))


class ModelsHandler(APIHandler):
    async def get(self):
        self.write_json({"models": await self.manager.models.list(self.principal())})

    async def post(self):
        who = self.principal()
        status, body = await self.manager.models.register(who, self.json_body())
        self.write_json(body, status)


class ModelArgs(APIHandler):
    """The path parameters of the model routes, each checked against its pattern (400 naming it)."""

    def name_arg(self, value: str) -> str:
        return self.path_arg(value, "name", MODEL, "a model name")

    def version_arg(self, value: str) -> int:
        return int(self.path_arg(value, "version", MODEL_VERSION, "a version number (1, 2, ...)"))

    def alias_arg(self, value: str) -> str:
        return self.path_arg(value, "alias", ALIAS, "an alias (a letter, then letters, digits, - and _)")


class ModelHandler(ModelArgs):
    async def get(self, name):
        self.write_json(await self.manager.models.show(self.principal(), self.name_arg(name)))


class ModelVersionHandler(ModelArgs):
    async def get(self, name, version):
        who = self.principal()
        self.write_json(await self.manager.models.version_view(who, self.name_arg(name), self.version_arg(version)))


class ModelFilesHandler(ModelArgs):
    """A version's stored copy (read as the version is: :mod:`~danlu.hub.service.registry.access`): its manifest
    (``{"name", "version", "digest", "files"}``), or with ``?path=`` one file it lists, streamed unchanged."""

    async def get(self, name, version):
        who = self.principal()
        name, number = self.name_arg(name), self.version_arg(version)
        path = self.str_arg("path", None, max_length=MODEL_FILE_PATH)
        if path is None:
            self.write_json(await self.manager.models.stored(who, name, number))
            return
        fd = await self.manager.models.stored(who, name, number, path)
        try:
            self.set_header("Content-Type", "application/octet-stream")
            self.set_header("Content-Disposition", "attachment")
            offset = 0
            while data := await asyncio.to_thread(os.pread, fd, CHUNK, offset):
                offset += len(data)
                self.write(data)
                try:
                    await self.flush()
                except StreamClosedError:
                    return
        finally:
            os.close(fd)
        self.finish()


class ModelDecisionsHandler(ModelArgs):
    async def post(self, name, version):
        who = self.principal()
        name, number = self.name_arg(name), self.version_arg(version)
        self.write_json(await self.manager.models.decide(who, name, number, self.json_body()))


class ModelAliasHandler(ModelArgs):
    async def put(self, name, alias):
        who = self.principal()
        name, alias = self.name_arg(name), self.alias_arg(alias)
        self.write_json(await self.manager.models.set_alias(who, name, alias, self.json_body()))

    async def delete(self, name, alias):
        who = self.principal()
        self.write_json(await self.manager.models.delete_alias(who, self.name_arg(name), self.alias_arg(alias)))


class LineageHandler(ModelArgs):
    async def get(self, name, version):
        who = self.principal()
        name, number = self.name_arg(name), self.version_arg(version)
        self.write_json(await self.manager.lineage(who, name, number))
