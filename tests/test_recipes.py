"""The recipes of docs/recipes.md, run as users run them (torchrun, 2 ranks): PyTorch Lightning's DDP
with process_group_backend="chainermn" (its sync_dist logging included), Hugging Face Accelerate on a
group created with chainermn first, the Hugging Face Trainer likewise (use_cpu=True), and DeepSpeed
ZeRO 1, 2 and 3 through deepspeed.init_distributed(dist_backend="chainermn"). The Trainer and DeepSpeed
runs are repeated on gloo in the same job and must match it bit for bit."""

import re

import pytest

from tests.support.harness import REPO, job_environment, run_job, torchrun


def run_recipe(name: str, *args: str) -> str:
    command = torchrun(2) + [str(REPO / "examples" / "recipes" / name), *args]
    code, output = run_job(command, job_environment(), timeout=240, what=name)
    assert code == 0, output[-4000:]
    return output


@pytest.mark.parametrize("recipe", ["lightning_ddp.py", "accelerate_ddp.py"])
def test_recipe_trains_on_chainermn(recipe):
    output = run_recipe(recipe)
    losses = [float(x) for x in re.findall(r"^epoch \d+ loss ([0-9.]+)$", output, re.MULTILINE)]
    summary = re.search(r"^backend (\S+) ranks (\d+) weights (\S+) (\S+)", output, re.MULTILINE)
    assert summary and len(losses) == 3, output[-4000:]
    assert summary.group(1, 2) == ("chainermn", "2")
    assert summary.group(3) == summary.group(4)  # the replicas are equal
    assert losses[-1] < losses[0]


def lines(output: str, pattern: str) -> dict:
    """{key: groups} of the lines matching `pattern`, whose first group is the key (a backend, a stage)."""
    found = {}
    for match in re.finditer(pattern, output, re.MULTILINE):
        assert match.group(1) not in found, f"{match.group(1)} twice:\n{output[-4000:]}"
        found[match.group(1)] = match.groups()[1:]
    return found


def test_hf_trainer_distributes_on_chainermn_as_on_gloo():
    """The Trainer on a group created with chainermn before its TrainingArguments (use_cpu=True): it saw
    2 processes in DISTRIBUTED mode and wrapped the model in DDP; the loss fell; both ranks end with the
    same parameters (a digest of their bytes), which moved; and the run on gloo in the same job logged
    the same losses and ended with the same parameters, bit for bit."""
    output = run_recipe("hf_trainer.py", "--backends", "chainermn", "gloo")
    losses = lines(output, r"^backend (\S+) losses (.+)$")
    trainer = lines(output, r"^backend (\S+) trainer world_size (\d+) parallel_mode (\S+) model (\S+)$")
    final = lines(output, r"^backend (\S+) ranks (\d+) moved ([0-9.]+) weights (\S+) (\S+)$")
    assert losses.keys() == trainer.keys() == final.keys() == {"chainermn", "gloo"}, output[-4000:]
    assert trainer["chainermn"] == ("2", "distributed", "DistributedDataParallel")
    curve = [float(v) for v in losses["chainermn"][0].split()]
    assert len(curve) == 8 and curve[-1] < curve[0], curve
    ranks, moved, rank0, rank1 = final["chainermn"]
    assert ranks == "2" and float(moved) > 0 and rank0 == rank1
    assert losses["chainermn"] == losses["gloo"]
    assert final["chainermn"] == final["gloo"]


def test_deepspeed_zero_stages_on_chainermn_as_on_gloo():
    """DeepSpeed ZeRO 1, 2 and 3 on deepspeed.init_distributed(dist_backend="chainermn"): the group is
    chainermn's; in every stage the loss fell, both ranks end with the same full parameters (a digest of
    their bytes; stage 3 gathers them), which moved; and each stage's losses and parameters are those of
    the same run on gloo in the same job, bit for bit."""
    output = run_recipe("deepspeed_zero.py", "--backends", "chainermn", "gloo")
    runs = {}
    for backend in ("chainermn", "gloo"):
        losses = lines(output, rf"^backend {backend} stage (\d) losses (.+)$")
        final = lines(output, rf"^backend {backend} stage (\d) ranks (\d+) moved ([0-9.]+) weights (\S+) (\S+)$")
        assert losses.keys() == final.keys() == {"1", "2", "3"}, output[-4000:]
        runs[backend] = losses, final
    losses, final = runs["chainermn"]
    for stage in ("1", "2", "3"):
        curve = [float(v) for v in losses[stage][0].split()]
        assert len(curve) == 6 and curve[-1] < curve[0], (stage, curve)
        ranks, moved, rank0, rank1 = final[stage]
        assert ranks == "2" and float(moved) > 0 and rank0 == rank1, (stage, final[stage])
    assert runs["chainermn"] == runs["gloo"]
