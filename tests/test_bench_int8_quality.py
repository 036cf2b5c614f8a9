"""The int8 quality benchmark's pure parts: its prompts and how answers are compared."""
import pytest

from hearth_llm.benchmarks import int8_quality


def test_prompts_are_distinct_and_bounded():
    made = int8_quality.prompts(32)
    assert len(made) == len(set(made)) == 32
    with pytest.raises(ValueError, match="--prompts"):
        int8_quality.prompts(33)


def test_compare_counts_equal_answers_and_common_prefixes():
    assert int8_quality.compare([[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 6], [8, 9]]) == (1, 4 / 3)
    assert int8_quality.compare([[1, 2]], [[1, 2, 3]]) == (0, 2.0)  # a longer answer is not equal
