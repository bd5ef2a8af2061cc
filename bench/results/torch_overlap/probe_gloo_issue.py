"""Probe (bench/results/torch_overlap/README.md): how long torch's async all_gather / reduce_scatter (gloo, CPU) and DTensor's redistribute(async_op=True)
take to return, against their whole time.

Run with a python that has torch: PY probe_gloo_issue.py (starts 2 gloo processes on 127.0.0.1;
WORLD=N for N). Prints one line per size and call: median issue and total time over 20 calls.
"""
import os, sys, time, statistics, datetime, ctypes

def worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, Replicate
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    libc = ctypes.CDLL(None); libc.prctl(29, 1, 0, 0, 0)
    mesh = init_device_mesh("cpu", (world,))
    for mib in (4, 8, 16):
        n = (mib << 20) // 4
        inp = torch.ones(n // world); out = torch.empty(n)
        big = torch.ones(n); small = torch.empty(n // world)
        x = DTensor.from_local(torch.ones(n // world // 1024, 1024), mesh, [Shard(0)], run_check=False)
        res = {}
        for name, issue in (
            ("raw all_gather", lambda: dist.all_gather_into_tensor(out, inp, async_op=True)),
            ("raw reduce_scatter", lambda: dist.reduce_scatter_tensor(small, big, async_op=True)),
            ("dtensor S(0)->R", lambda: x.redistribute(mesh, [Replicate()], async_op=True)),
        ):
            iss, tot = [], []
            for it in range(25):
                dist.barrier()
                time.sleep(0.002)
                t0 = time.perf_counter_ns()
                h = issue()
                t1 = time.perf_counter_ns()
                if isinstance(h, DTensor):
                    loc = h.to_local()
                    if hasattr(loc, "wait"): loc.wait()
                else:
                    h.wait()
                t2 = time.perf_counter_ns()
                if it >= 5:
                    iss.append((t1 - t0) / 1e3); tot.append((t2 - t0) / 1e3)
            res[name] = (statistics.median(iss), statistics.median(tot))
        if rank == 0:
            for k, (a, b) in res.items():
                print(f"{mib:3d} MiB  {k:20s} issue {a:9.1f} us  total {b:9.1f} us  issue/total {a / b:.2f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])); sys.exit(0)
    import subprocess, socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    world = int(os.environ.get("WORLD", "2"))
    ps = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port)]) for r in range(world)]
    sys.exit(max(p.wait() for p in ps))
