"""The usual lineage clients against a real `aether serve`, unchanged.

A job is sent with openlineage-python's `HttpTransport` (the producer side), and every read
call of the official Marquez Python client (marquez-python 0.50) is made against
`/api/v1` (the consumer side): each must answer in Marquez's shape with what was sent.
Run by `scripts/test.sh` in a virtual environment of its own (pinned versions); by hand:

    AETHER_BIN=target/debug/aether python -m unittest tests/marquez/test_marquez_client.py
"""

import datetime
import os
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.request
import uuid

from marquez_client import MarquezClient
from openlineage.client import OpenLineageClient
from openlineage.client.event_v2 import Dataset, Job, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    column_lineage_dataset,
    schema_dataset,
)
from openlineage.client.transport.http import ApiKeyTokenProvider, HttpConfig, HttpTransport

OPERATOR = "marquez-operator-token-0123456789"
REGULATOR = "marquez-regulator-token-0123456789"
PRODUCER = "https://bank.example/feature-platform"
RUN_ID = str(uuid.uuid4())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aether_bin():
    if os.environ.get("AETHER_BIN"):
        return os.environ["AETHER_BIN"]
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(os.path.dirname(__file__), "../../target"))
    return os.path.join(target, "debug", "aether")


class MarquezClientsUnchanged(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.TemporaryDirectory()
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        env["AETHER_TOKENS"] = f"operator:{OPERATOR},regulator:{REGULATOR}"
        cls.log = open(os.path.join(cls.work.name, "serve.log"), "wb")
        cls.server = subprocess.Popen(
            [aether_bin(), "serve", "--data-dir", os.path.join(cls.work.name, "data"),
             "--listen", f"127.0.0.1:{port}", "--no-grpc"],
            env=env, stdout=subprocess.DEVNULL, stderr=cls.log,
        )
        cls.url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"{cls.url}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            cls.tearDownClass()
            raise RuntimeError("aether serve did not become ready")

        # The producer: openlineage-python's HTTP transport, as a pipeline would send.
        transport = HttpTransport(HttpConfig(url=cls.url, auth=ApiKeyTokenProvider({"apiKey": OPERATOR})))
        producer = OpenLineageClient(transport=transport)
        raw = Dataset(namespace="s3://raw", name="trades")
        features = Dataset(
            namespace="s3://features",
            name="trades_v1",
            facets={
                "schema": schema_dataset.SchemaDatasetFacet(fields=[
                    schema_dataset.SchemaDatasetFacetFields(name="amount", type="DECIMAL"),
                    schema_dataset.SchemaDatasetFacetFields(name="amount_usd", type="DECIMAL"),
                ]),
                "columnLineage": column_lineage_dataset.ColumnLineageDatasetFacet(fields={
                    "amount_usd": column_lineage_dataset.Fields(
                        inputFields=[column_lineage_dataset.InputField(namespace="s3://raw", name="trades", field="amount")],
                        transformationDescription="amount times the day's rate",
                        transformationType="",
                    ),
                }),
            },
        )
        job = Job(namespace="features", name="build_trade_features")
        now = datetime.datetime.now(datetime.timezone.utc)
        for state, at in [(RunState.START, now - datetime.timedelta(seconds=90)), (RunState.COMPLETE, now)]:
            producer.emit(RunEvent(
                eventType=state, eventTime=at.isoformat(), run=Run(runId=RUN_ID), job=job,
                producer=PRODUCER, inputs=[raw], outputs=[features],
            ))
        # The consumer: the Marquez client, reading as the regulator.
        cls.marquez = MarquezClient(cls.url, api_key=REGULATOR)

    @classmethod
    def tearDownClass(cls):
        cls.server.terminate()
        cls.server.wait(timeout=30)
        cls.log.close()
        cls.work.cleanup()

    def test_namespaces(self):
        names = [n["name"] for n in self.marquez.list_namespaces()["namespaces"]]
        self.assertIn("features", names)
        self.assertEqual(self.marquez.get_namespace("features")["name"], "features")

    def test_the_job_sent_reads_back(self):
        jobs = [j["name"] for j in self.marquez.list_jobs("features")["jobs"]]
        self.assertIn("build_trade_features", jobs)
        job = self.marquez.get_job("features", "build_trade_features")
        self.assertEqual(job["latestRun"]["id"], RUN_ID)
        self.assertEqual(job["latestRun"]["state"], "COMPLETED")
        self.assertEqual(job["inputs"], [{"namespace": "s3://raw", "name": "trades"}])
        runs = self.marquez.list_job_runs("features", "build_trade_features")["runs"]
        self.assertEqual([r["id"] for r in runs], [RUN_ID])
        self.assertEqual(self.marquez.get_job_run(RUN_ID)["state"], "COMPLETED")

    def test_the_datasets_sent_read_back(self):
        names = [d["name"] for d in self.marquez.list_datasets("s3://features")["datasets"]]
        self.assertEqual(names, ["trades_v1"])
        dataset = self.marquez.get_dataset("s3://features", "trades_v1")
        self.assertEqual([f["name"] for f in dataset["fields"]], ["amount", "amount_usd"])
        versions = self.marquez.list_dataset_versions("s3://features", "trades_v1")["versions"]
        self.assertEqual(len(versions), 1)
        version = self.marquez.get_dataset_version("s3://features", "trades_v1", versions[0]["version"])
        self.assertEqual(version["createdByRun"], {"id": RUN_ID})

    def test_events_sources_and_tags(self):
        events = self.marquez.list_events(limit=1000)["events"]
        self.assertTrue(any(e.get("run", {}).get("runId") == RUN_ID for e in events))
        sources = [s["name"] for s in self.marquez.list_sources()["sources"]]
        self.assertIn("s3://features", sources)
        self.assertEqual(self.marquez.list_tags()["tags"], [])

    def test_column_lineage(self):
        node = "datasetField:s3://features:trades_v1:amount_usd"
        for graph in [
            self.marquez.get_column_lineage_by_dataset("s3://features", "trades_v1"),
            self.marquez.get_column_lineage_by_dataset_field("s3://features", "trades_v1", "amount_usd"),
            self.marquez.get_column_lineage_by_job("features", "build_trade_features"),
        ]:
            by_id = {n["id"]: n for n in graph["graph"]}
            self.assertIn(node, by_id)
            self.assertEqual(
                by_id[node]["inEdges"],
                [{"origin": "datasetField:s3://raw:trades:amount", "destination": node}],
            )
            self.assertEqual(by_id[node]["data"]["transformationDescription"], "amount times the day's rate")

    def test_a_missing_node_is_an_error_not_an_empty_answer(self):
        from marquez_client.errors import APIError
        with self.assertRaises(APIError):
            self.marquez.get_job("features", "no_such_job")
        with self.assertRaises(APIError):
            self.marquez.get_namespace("no-such-namespace")


if __name__ == "__main__":
    unittest.main()
