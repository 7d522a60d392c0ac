"""The recipes of docs/recipes.md, run as users run them (torchrun, 2 ranks): PyTorch Lightning's DDP
with process_group_backend="chainermn" (its sync_dist logging included), and Hugging Face Accelerate
on a group created with chainermn first."""
import re

import pytest

from tests.support.harness import REPO, job_environment, run_job, torchrun


def run_recipe(name: str) -> str:
    command = torchrun(2) + [str(REPO / "examples" / "recipes" / name)]
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
