"""Check device pinning on a GPU machine: which process holds GPU memory, per nvidia-smi.

Starts a target on the GPU, a model draft pinned to the CPU (`--device cpu`) and one on the GPU, decodes a few
tokens through each, then reads nvidia-smi's per-process memory. A CPU-pinned draft must hold no GPU memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tandem.launch import start_model_service
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc


def _smi(query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False
    ).stdout
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_memory_by_pid() -> dict[int, dict[int, int]]:
    """{pid: {gpu index: MiB}} from nvidia-smi's compute-apps view."""
    index_of = {uuid: int(index) for index, uuid in _smi("--query-gpu=index,uuid")}
    usage: dict[int, dict[int, int]] = {}
    for pid, uuid, mib in _smi("--query-compute-apps=pid,gpu_uuid,used_memory"):
        if pid.isdigit():
            usage.setdefault(int(pid), {})[index_of.get(uuid, -1)] = int(mib) if mib.isdigit() else -1
    return usage


def total_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return sum(int(x) for x in out.split() if x.isdigit())


def exercise(address: str, stub_type, info_only: bool = False) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        stub = stub_type(channel)
        info = stub.Info(pb.InfoRequest())
        item = pb.OpenItem(session_id="pin", prompt_token_ids=[1, 504, 2573, 1244], sampling=pb.SamplingParams())
        stub.Open(pb.OpenRequest(items=[item]))
        stub.Close(pb.CloseRequest(session_ids=["pin"]))
        return info


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--second-gpu", action="store_true", help="also a draft pinned to cuda:1 (2-GPU machines)")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp())
    model = ["--model", args.model]
    base = total_used_mib()
    rows = []
    procs = []
    try:
        gpu = ["--n-gpu-layers", "-1", "--device", "cuda:0"]
        for name, module, stub, flags in [
            ("target@cuda:0", "services.target", pb_grpc.TargetStub, gpu),
            (
                "draft@cpu",
                "services.draft",
                pb_grpc.DraftStub,
                ["--drafter", "model", "--device", "cpu", "--n-threads", "8"],
            ),
            ("draft@cuda:0", "services.draft", pb_grpc.DraftStub, ["--drafter", "model", *gpu]),
        ] + (
            [("draft@cuda:1", "services.draft", pb_grpc.DraftStub,
              ["--drafter", "model", "--n-gpu-layers", "-1", "--device", "cuda:1"])]
            if args.second_gpu else []
        ):  # fmt: skip
            before = total_used_mib()
            svc = start_model_service(module, [*model, *flags], logs)
            procs.append(svc)
            info = exercise(svc.address, stub)
            time.sleep(0.5)
            rows.append((name, svc.pid, info.backend, info.device, total_used_mib() - before))
        by_pid = gpu_memory_by_pid()
        print(f"GPU memory in use before: {base} MiB; nvidia-smi per-process view: {by_pid or 'not available here'}")
        print("| service | pid | backend | device | GPU MiB by GPU index (nvidia-smi per pid) | total delta MiB |")
        print("|---|---|---|---|---|---|")
        ok = True
        for name, pid, backend, device, delta in rows:
            per_gpu = by_pid.get(pid, {})
            print(f"| {name} | {pid} | {backend} | {device} | {per_gpu or 0} | {delta} |")
            if name == "draft@cpu" and (per_gpu or delta > 0 or backend != "CPU"):
                ok = False
            if name == "draft@cuda:1" and (per_gpu.get(0, 0) > 0 or per_gpu.get(1, 0) <= 0):
                ok = False  # must sit on GPU 1 only
        print("pinning holds (CPU draft: no GPU memory; cuda:1 draft: nothing on GPU 0):", "yes" if ok else "NO")
        return 0 if ok else 1
    finally:
        for svc in procs:
            svc.stop()


if __name__ == "__main__":
    sys.exit(main())
