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


def gpu_memory_by_pid() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    usage: dict[int, int] = {}
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        if pid.isdigit():
            usage[int(pid)] = int(mib) if mib.isdigit() else -1
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
        ]:
            before = total_used_mib()
            svc = start_model_service(module, [*model, *flags], logs)
            procs.append(svc)
            info = exercise(svc.address, stub)
            time.sleep(0.5)
            rows.append((name, svc.pid, info.backend, info.device, total_used_mib() - before))
        by_pid = gpu_memory_by_pid()
        print(f"GPU memory in use before: {base} MiB; nvidia-smi per-process view: {by_pid or 'not available here'}")
        print("| service | pid | backend | device | GPU MiB (nvidia-smi by pid) | GPU MiB (total delta at start) |")
        print("|---|---|---|---|---|---|")
        ok = True
        for name, pid, backend, device, delta in rows:
            per_pid = by_pid.get(pid, 0) if by_pid else None
            print(f"| {name} | {pid} | {backend} | {device} | {per_pid if per_pid is not None else '-'} | {delta} |")
            if name == "draft@cpu" and ((per_pid or 0) > 0 or delta > 0 or backend != "CPU"):
                ok = False
        print("CPU-pinned draft holds no GPU memory:", "yes" if ok else "NO")
        return 0 if ok else 1
    finally:
        for svc in procs:
            svc.stop()


if __name__ == "__main__":
    sys.exit(main())
