"""ReasoningGymReward defers correctness to reasoning-gym's own score_answer."""
import pytest

import reasoning_gym as rg  # installed by `make test` (tasks extra)

from megatron_calibclip.rl import ReasoningGymReward  # noqa: E402


@pytest.fixture(scope="module")
def chain_sum():
    return rg.create_dataset("chain_sum", size=4, seed=7)


def test_right_and_wrong_answers_in_answer_tags(chain_sum):
    reward = ReasoningGymReward(chain_sum)
    for entry in chain_sum:
        right = f"<think>adding up</think>\n<answer>{entry['answer']}</answer>"
        wrong = f"<answer>{int(entry['answer']) + 1}</answer>"
        assert reward(right, entry) == 1.0
        assert reward(wrong, entry) == 0.0
        assert reward("I don't know", entry) == 0.0  # no tag -> missing_reward (= wrong)


def test_scorer_from_metadata_and_dapo_mapping(chain_sum):
    entry = chain_sum[0]
    # no dataset given: the scorer is looked up from entry['metadata']['source_dataset']
    reward = ReasoningGymReward(correct_reward=1.0, wrong_reward=-1.0, missing_reward=-2.0)
    assert reward(f"<answer>{entry['answer']}</answer>", entry) == 1.0
    assert reward(f"<answer>{int(entry['answer']) - 3}</answer>", entry) == -1.0
    assert reward("no tags", entry) == -2.0
    assert reward.score("no tags", entry) is None


def test_other_extractions_and_format_bonus(chain_sum):
    entry = chain_sum[1]
    boxed = ReasoningGymReward(chain_sum, extraction="boxed", format_weight=0.5)
    assert boxed(f"so \\boxed{{{entry['answer']}}}", entry) == 1.5
    assert boxed(f"so {entry['answer']}", entry) == 0.0  # right number but no box
    final = ReasoningGymReward(chain_sum, extraction="final_answer")
    assert final(f"the sum is {entry['answer']}", entry) == 1.0
    raw = ReasoningGymReward(chain_sum, extraction="raw")
    assert raw(f"  {entry['answer']} ", entry) == 1.0


def test_errors():
    with pytest.raises(ValueError, match="extraction"):
        ReasoningGymReward(extraction="json")
    with pytest.raises(ValueError, match="dataset"):
        ReasoningGymReward(object())
    with pytest.raises(ValueError, match="source_dataset"):
        ReasoningGymReward()("<answer>1</answer>", {"answer": "1"})
