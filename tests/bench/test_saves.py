"""`k3 bench parallel --saves`: the figures of a job (`k3.bench.saves.summary`) read the right steps."""

from k3.bench.saves import summary


def test_summary_takes_the_step_after_each_save_and_the_plain_ones():
    # 8 steps, a save after the 4th and the 8th: the 5th step (index 4) is the one after a save
    ranks = [
        {"steps": [9.0, 9.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0], "saves": [2.0, 2.0], "saved step": 8},
        {"steps": [1.0] * 8, "saves": [0.5, 0.5], "saved step": None},
    ]
    figures = summary(ranks, every=4)
    assert figures == {"plain step s": 1.0, "save call s": 2.0, "save + next step s": 5.0, "saved step": 8}
