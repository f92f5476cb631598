"""Two nodes on one machine, and SLURM's ranks on the same mesh.

``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 2`` on the loopback address, two
processes per "node", runs ``lightning_parallel/testing/elastic_job.py`` (``--no-crash``) with
``Trainer(num_nodes=2)``:

* ``hsdp`` replicates across the two nodes and shards within each (the replicate group of
  rank 0 is ``[0, 2]``, its shard group ``[0, 1]``);
* ``3d`` keeps tensor parallelism inside a node (``tp`` group ``[0, 1]``) and puts pipeline
  stages across nodes (``pp`` group ``[0, 2]``);

and both match one process (per-step losses and final parameters, fp32, relative 1e-5).
Lightning's ``SLURMEnvironment`` reads ranks from ``SLURM_*`` variables; simulated for 2
nodes x 2 tasks, its global ranks put node ``i``'s tasks at ``2i, 2i + 1``, which is exactly
where the mesh (``pp, dp_replicate, dp_shard, tp``, row-major over global ranks) expects a node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel.launcher import free_port
from lightning_parallel.testing.elastic_job import SPEC_KWARGS, fit_spec
from lightning_parallel.testing.parity import run_fit


@pytest.mark.slow
def test_two_nodes_on_loopback_hsdp_and_3d_match_one_process(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "lightning_parallel.testing.elastic_job",
             "--out", str(tmp_path), "--strategies", "hsdp,3d", "--no-crash", "--num-nodes", "2", "--timeout", "120"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for proc in nodes:
            outputs.append(proc.communicate(timeout=900)[0])
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
    for node, (proc, out) in enumerate(zip(nodes, outputs)):
        assert proc.returncode == 0, f"node {node}:\n{out[-4000:]}"
    reference = run_fit(fit_spec("auto", 1, tmp_path / "reference", "reference", crash=False))
    expected_groups = {
        "hsdp": {"dp_replicate": [0, 2], "dp_shard": [0, 1]},
        "3d": {"tp": [0, 1], "pp": [0, 2]},
    }
    for name, groups in expected_groups.items():
        result = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        for axis, ranks in groups.items():
            assert result["layout"]["groups"][axis] == ranks, f"{name}: {result['layout']}"
        assert len(result["losses"]) == SPEC_KWARGS["max_steps"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name} losses: {m}")
        for key, ref in reference["params"].items():
            error = float((result["params"][key] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert error <= 1e-5 or float(ref.norm()) < 1e-8, f"{name} {key}: relative error {error:.2e}"


def test_slurm_ranks_map_nodes_onto_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_parallel import HybridParallelStrategy

    placed: dict[int, list[int]] = {}
    for node in range(2):
        for local in range(2):
            proc = 2 * node + local
            for key, value in {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(proc),
                               "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURM_NNODES": "2",
                               "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "1234", "SLURM_NODELIST": "node[1-2]"}.items():
                monkeypatch.setenv(key, value)
            environment = SLURMEnvironment()
            assert (environment.world_size(), environment.node_rank(), environment.local_rank()) == (4, node, local)
            placed.setdefault(node, []).append(environment.global_rank())
    assert placed == {0: [0, 1], 1: [2, 3]}
    strategy = HybridParallelStrategy(zero_stage=3, hybrid_shard=True)
    strategy._num_nodes = 2
    dims = strategy.resolve_dims(4)
    grid = torch.arange(4).reshape(dims.shape)  # how init_device_mesh lays global ranks on the mesh
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)
    for node, ranks in placed.items():  # one replica per node, the shard group inside it
        assert grid[0, node, :, 0, 0].tolist() == ranks  # mesh (pp, dp_replicate, dp_shard, cp, tp)
