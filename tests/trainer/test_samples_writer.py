"""SampleWriter without a model: which sequences a step writes, the record format, and a
resumed run keeping only the lines of the steps before its resume point."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from megatron_calibclip.rollout import RolloutBatch
from megatron_calibclip.trainer.samples import SampleWriter, pick


class CharTokenizer:
    """ids are character codes (0: padding)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)


def _data(prompts: list[str], responses: list[str], rewards: list[float], advantages: list[float],
          finished: list[bool]) -> SimpleNamespace:
    width = max(map(len, prompts))
    rows = [[0] * (width - len(p)) + [ord(ch) for ch in p] + [ord(ch) for ch in r] for p, r in zip(prompts, responses)]
    total = max(map(len, rows))
    tokens = torch.tensor([row + [0] * (total - len(row)) for row in rows])
    batch = RolloutBatch(tokens, width, torch.tensor([len(p) for p in prompts]),
                         torch.tensor([len(r) for r in responses]), torch.tensor(finished),
                         torch.zeros(len(rows), total - 1), 0)
    return SimpleNamespace(batch=batch, rewards=torch.tensor(rewards), advantages=torch.tensor(advantages))


def test_pick_goes_round_robin_over_the_groups():
    assert pick(8, 4, 3) == [0, 4, 1]
    assert pick(8, 4, 100) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert pick(3, 4, 2) == [0, 1]  # a partial group


def test_records_and_resume(tmp_path):
    data = _data(["1+2=", "30+4="], ["3", "34!"], [1.0, 0.0], [0.7071, -0.7071], [True, False])
    writer = SampleWriter(tmp_path, every=2, count=4, group_size=1, enabled=True)
    for step in range(5):
        if writer.due(step):
            writer.write(step, data, CharTokenizer())
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 0, 2, 2, 4, 4]
    assert lines[1] == {"step": 0, "group": 1, "sample": 0, "prompt": "30+4=", "response": "34!",
                        "reward": 0.0, "advantage": float(torch.tensor(-0.7071)), "eos": False, "length": 3}
    # resumed from step 3: the lines of steps 0-2 stay, step 4's (not in the checkpoint) go
    resumed = SampleWriter(tmp_path, every=2, count=1, group_size=1, enabled=True, start_step=3)
    resumed.write(4, data, CharTokenizer())
    resumed.close()
    again = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in again] == [(0, "1+2="), (0, "30+4="), (2, "1+2="), (2, "30+4="),
                                                         (4, "1+2=")]
    # other ranks, and samples.every 0, write nothing
    assert not SampleWriter(tmp_path / "x", every=1, count=1, group_size=1, enabled=False).due(0)
    assert not SampleWriter(tmp_path / "y", every=0, count=1, group_size=1, enabled=True).due(0)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
