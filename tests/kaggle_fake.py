"""A small stand-in for Kaggle's API, for the real `kaggle` client to talk to in tests.

The client has a local environment: KAGGLE_API_ENVIRONMENT=LOCALHOST makes it call
http://localhost/api/v1/{Service}/{Method} (POST, camelCase JSON). Run in a subprocess with
HTTP_PROXY=http://127.0.0.1:PORT, requests sends every call in absolute form to this server, which
answers the calls `ptbr kaggle` makes as Kaggle does (what kaggle 2.2 sends and expects):

  datasets.DatasetApiService/GetDatasetStatus    404 for an unknown dataset, else its status
  blobs.BlobApiService/StartBlobUpload           a token and a URL to PUT the bytes to
  datasets.DatasetApiService/CreateDataset       the files of the uploads named by token; a folder
  datasets.DatasetApiService/CreateDatasetVersion  sent as NAME.zip is listed unpacked, as NAME/...
  datasets.DatasetApiService/ListDatasetFiles    paged
  datasets.DatasetApiService/DownloadDataset     one file of the newest version: a redirect to its URL
  kernels.KernelsApiService/SaveKernel           sources that do not exist are refused
  kernels.KernelsApiService/GetKernelSessionStatus
  kernels.KernelsApiService/GetKernel            the newest version's code (blob.source)
  kernels.KernelsApiService/ListKernelSessionOutput  files with URLs this server serves, and the log
  models.ModelApiService/GetModelInstance        the newest version of a model
  security.OAuthService/IntrospectToken          for KAGGLE_API_TOKEN

Legacy credentials (KAGGLE_USERNAME/KAGGLE_KEY) arrive as HTTP basic auth and are checked on every
call; a wrong key is 401. `fail_uploads` names files whose PUT answers 500: the client then leaves
them out of the dataset and still reports success, as it does against Kaggle; `fail_methods`
answers a method with an HTTP error (a 503: Kaggle's side failing), `failures` with one HTTP error
per call from a list, then normally; a method in `hang` is not answered until the server closes.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

USERNAME = "ptbr-tester"
KEY = "0123456789abcdef0123456789abcdef"  # a test key: a bundle, log or output must never contain it
TOKEN = "KGAT_fake_token_for_tests_0123456789"


@dataclass
class Dataset:
    versions: list[dict[str, bytes]] = field(default_factory=list)  # each version: {name: content}
    statuses: list[str] = field(default_factory=list)  # what GetDatasetStatus answers next; then READY


@dataclass
class Kernel:
    pushes: list[dict] = field(default_factory=list)  # each SaveKernel request body
    statuses: list[str] = field(default_factory=lambda: ["COMPLETE"])  # answered in turn; the last one stays
    failure_message: str | None = None
    outputs: dict[str, bytes] = field(default_factory=dict)
    log: str = ""
    source: str | None = None  # the code of a kernel made elsewhere (else the newest push's)


class FakeKaggle:
    """The server and what it holds; tests set its state and read what the client sent."""

    def __init__(self) -> None:
        self.datasets: dict[str, Dataset] = {}
        self.kernels: dict[str, Kernel] = {}
        self.models: dict[str, int] = {}  # OWNER/MODEL/FRAMEWORK/VARIATION -> newest version
        self.blobs: dict[str, dict] = {}  # token -> {"name", "content"}
        self.fail_uploads: set[str] = set()
        self.missing_outputs: set[str] = set()  # output files whose download answers 404
        self.create_status: str | None = None  # CreateDataset answers this error instead of "Ok"
        self.save_kernel_error: str | None = None
        self.fail_methods: dict[str, int] = {}  # method -> the HTTP status it answers instead
        self.failures: dict[str, list[int]] = {}  # method -> HTTP statuses its next calls answer, in turn
        self.hang: set[str] = set()  # methods that get no answer (until the server closes)
        self._closing = threading.Event()
        self.calls: list[str] = []  # "Service/Method" of every API call, in order
        self.dataset_statuses_after_upload = ["NOT_YET_PERSISTED", "BLOBS_RECEIVED"]
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        # a short poll: closing the server waits for serve_forever's next look (0.5 s by default)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def __enter__(self) -> FakeKaggle:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def env(self, home: str, tmp: str, credentials: str = "key") -> dict[str, str]:
        """The environment a `ptbr kaggle` subprocess talks to this server with; `credentials`: key,
        token, or none (HOME and TMPDIR are the test's own: the client keeps state under both)."""
        import os

        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KAGGLE_") and k.lower() not in ("no_proxy", "https_proxy", "all_proxy")}
        env.update(HOME=home, TMPDIR=tmp, KAGGLE_API_ENVIRONMENT="LOCALHOST",
                   HTTP_PROXY=f"http://127.0.0.1:{self.port}", http_proxy=f"http://127.0.0.1:{self.port}")
        if credentials == "key":
            env.update(KAGGLE_USERNAME=USERNAME, KAGGLE_KEY=KEY)
        elif credentials == "token":
            env.update(KAGGLE_API_TOKEN=TOKEN)
        elif credentials.startswith("token:"):
            env.update(KAGGLE_API_TOKEN=credentials.removeprefix("token:"))
        elif credentials.startswith("key:"):
            env.update(KAGGLE_USERNAME=USERNAME, KAGGLE_KEY=credentials.removeprefix("key:"))
        return env

    def listed(self, dataset: str) -> dict[str, int]:
        """{name: bytes} of the newest version, as ListDatasetFiles lists it: a folder sent as a
        .zip archive unpacked into NAME/..."""
        files: dict[str, int] = {}
        for name, content in self.datasets[dataset].versions[-1].items():
            if name.endswith(".zip"):
                with zipfile.ZipFile(io.BytesIO(content)) as archive:
                    for info in archive.infolist():
                        if not info.is_dir():
                            files[f"{name.removesuffix('.zip')}/{info.filename}"] = info.file_size
            else:
                files[name] = len(content)
        return files

    # --- the API ---------------------------------------------------------------------------------

    def answer(self, method: str, body: dict, auth: str | None) -> tuple[int, dict]:
        if method in self.hang:
            self._closing.wait(60)
            return 0, {}  # no answer: the connection is closed
        if self.failures.get(method) or method in self.fail_methods:
            status = self.failures[method].pop(0) if self.failures.get(method) else self.fail_methods[method]
            message = {403: "Permission denied", 429: "Too Many Requests"}.get(status, "Service Unavailable")
            return status, {"code": status, "message": message}
        if method == "IntrospectToken":
            active = body.get("token") == TOKEN
            return 200, {"active": active, "username": USERNAME if active else ""}
        if auth not in (_basic(USERNAME, KEY), f"Bearer {TOKEN}"):
            return 401, {"code": 401, "message": "Unauthenticated"}
        handler = getattr(self, f"_{method}", None)
        if handler is None:
            return 404, {"code": 404, "message": f"the fake has no {method}"}
        return handler(body)

    def _GetDatasetStatus(self, body):
        dataset = self.datasets.get(f"{body['ownerSlug']}/{body['datasetSlug']}")
        if dataset is None:
            return 404, {"code": 404, "message": "Not found"}
        return 200, {"status": dataset.statuses.pop(0) if dataset.statuses else "READY"}

    def _StartBlobUpload(self, body):
        token = f"blob{len(self.blobs)}"
        self.blobs[token] = {"name": body["name"], "content": None}
        return 200, {"token": token, "createUrl": f"http://localhost/upload/{token}"}

    def _files(self, tokens: list[dict]) -> dict[str, bytes]:
        return {self.blobs[t["token"]]["name"]: self.blobs[t["token"]]["content"] for t in tokens
                if self.blobs.get(t["token"], {}).get("content") is not None}

    def _CreateDataset(self, body):
        ref = f"{body['ownerSlug']}/{body['slug']}"
        if self.create_status:
            return 200, {"status": "Error", "error": self.create_status}
        self.datasets[ref] = Dataset([self._files(body.get("files", []))], list(self.dataset_statuses_after_upload))
        self.private = body.get("isPrivate")
        return 200, {"ref": ref, "url": f"https://www.kaggle.com/datasets/{ref}", "status": "Ok"}

    def _CreateDatasetVersion(self, body):
        ref = f"{body['ownerSlug']}/{body['datasetSlug']}"
        dataset = self.datasets[ref]
        dataset.versions.append(self._files(body["body"].get("files", [])))
        dataset.statuses = list(self.dataset_statuses_after_upload)
        return 200, {"ref": ref, "url": f"https://www.kaggle.com/datasets/{ref}", "status": "Ok"}

    def _ListDatasetFiles(self, body):
        files = sorted(self.listed(f"{body['ownerSlug']}/{body['datasetSlug']}").items())
        start = int(body.get("pageToken") or 0)
        size = min(int(body.get("pageSize") or 20), 20)  # pages smaller than asked, as a server may
        page = files[start:start + size]
        token = str(start + size) if start + size < len(files) else ""
        return 200, {"datasetFiles": [{"name": n, "totalBytes": b} for n, b in page], "nextPageToken": token}

    def _DownloadDataset(self, body):
        ref = f"{body['ownerSlug']}/{body['datasetSlug']}"
        if ref not in self.datasets or body.get("fileName") not in self.datasets[ref].versions[-1]:
            return 404, {"code": 404, "message": "Not found"}
        return 302, {"location": f"http://localhost/dataset-file/{ref}/{body['fileName']}"}

    def _SaveKernel(self, body):
        ref = body["slug"]
        if self.save_kernel_error:
            return 200, {"ref": ref, "url": "", "error": self.save_kernel_error}
        bad = {
            "invalidDatasetSources": [s for s in body.get("datasetDataSources", []) if s not in self.datasets],
            "invalidKernelSources": [s for s in body.get("kernelDataSources", []) if s not in self.kernels],
            "invalidModelSources": [s for s in body.get("modelDataSources", [])
                                    if s.count("/") != 4 or self.models.get(s.rsplit("/", 1)[0]) is None],
        }
        if any(bad.values()):
            return 200, {"ref": ref, "url": "", "error": "Invalid sources", **{k: v for k, v in bad.items() if v}}
        kernel = self.kernels.setdefault(ref, Kernel())
        kernel.pushes.append(body)
        return 200, {"ref": f"/code/{ref}", "url": f"https://www.kaggle.com/code/{ref}",
                     "versionNumber": len(kernel.pushes)}

    def _kernel(self, body) -> Kernel | None:
        return self.kernels.get(f"{body['userName']}/{body['kernelSlug']}")

    def _GetKernelSessionStatus(self, body):
        kernel = self._kernel(body)
        if kernel is None:
            return 404, {"code": 404, "message": "Not found"}
        status = kernel.statuses.pop(0) if len(kernel.statuses) > 1 else kernel.statuses[0]
        answer = {"status": status}
        if kernel.failure_message:
            answer["failureMessage"] = kernel.failure_message
        return 200, answer

    def _GetKernel(self, body):
        kernel = self._kernel(body)
        if kernel is None:
            return 404, {"code": 404, "message": "Not found"}
        source = kernel.source if kernel.source is not None else (kernel.pushes[-1]["text"] if kernel.pushes else "")
        slug = body["kernelSlug"]
        return 200, {"metadata": {"ref": f"{body['userName']}/{slug}", "slug": slug, "title": slug},
                     "blob": {"source": source, "language": "python", "kernelType": "script", "slug": slug}}

    def _ListKernelSessionOutput(self, body):
        kernel = self._kernel(body)
        if kernel is None:
            return 404, {"code": 404, "message": "Not found"}
        ref = f"{body['userName']}/{body['kernelSlug']}"
        files = [{"fileName": name, "url": f"http://localhost/output/{ref}/{name}"} for name in sorted(kernel.outputs)]
        return 200, {"files": files, "log": kernel.log}

    def _GetModelInstance(self, body):
        framework = body.get("framework", "").removeprefix("MODEL_FRAMEWORK_").lower()
        ref = f"{body['ownerSlug']}/{body['modelSlug']}/{framework}/{body['instanceSlug']}"
        if ref not in self.models:
            return 404, {"code": 404, "message": f"no model {ref}"}
        return 200, {"versionNumber": self.models[ref], "slug": body["instanceSlug"]}

    # --- uploads and downloads ---------------------------------------------------------------------

    def put(self, path: str, content: bytes) -> int:
        token = path.rsplit("/", 1)[1]
        blob = self.blobs.get(token)
        if blob is None:
            return 404
        if blob["name"] in self.fail_uploads:
            return 500
        blob["content"] = content
        return 200

    def get(self, path: str) -> tuple[int, bytes]:
        parts = path.split("/")  # /output/OWNER/SLUG/NAME... or /dataset-file/OWNER/SLUG/NAME
        if parts[1] == "dataset-file":
            dataset = self.datasets.get(f"{parts[2]}/{parts[3]}")
            content = dataset.versions[-1].get("/".join(parts[4:])) if dataset else None
            return (200, content) if content is not None else (404, b"<html>not found</html>")
        kernel = self.kernels.get(f"{parts[2]}/{parts[3]}")
        name = "/".join(parts[4:])
        if kernel is None or name not in kernel.outputs or name in self.missing_outputs:
            return 404, b"<html>not found</html>"
        return 200, kernel.outputs[name]


def _basic(user: str, key: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()


def _handler(fake: FakeKaggle):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the test's output is the client's
            pass

        def _path(self) -> str:
            return urlsplit(self.path).path  # requests sends absolute URLs to a proxy

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, payload: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_POST(self) -> None:
            path = self._path()
            body = json.loads(self._body() or b"{}")
            service, method = path.split("/")[-2:]
            fake.calls.append(f"{service}/{method}")
            status, answer = fake.answer(method, body, self.headers.get("Authorization"))
            if status == 0:
                self.close_connection = True
                return
            if status in (301, 302):
                self.send_response(status)
                self.send_header("Location", answer["location"])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._send(status, json.dumps(answer).encode(), "application/json")

        def do_PUT(self) -> None:
            status = fake.put(self._path(), self._body())
            self._send(status, b"", "text/plain")

        def do_GET(self) -> None:
            status, content = fake.get(self._path())
            self._send(status, content, "application/octet-stream")

    return Handler
