"""Progress bars report to a log while a pipeline stage runs as a Prefect task (`report_to`): throttled, with the
last line always, and nothing outside it."""

from dzmodel.progress import Progress, report_to


def _run(bar_total: int, updates: int, every_s: float, **kw) -> list[str]:
    lines: list[str] = []
    with report_to(lines.append, every_s=every_s):
        bar = Progress(bar_total, enabled=False, desc="eval", unit="episode", **kw)
        for _ in range(updates):
            bar.update()
    return lines


def test_each_update_reports_when_unthrottled_and_the_last_one_says_done():
    lines = _run(3, 3, every_s=0)
    assert [line.split(" (")[0] for line in lines] == ["eval: 1/3 episodes", "eval: 2/3 episodes", "eval: 3/3 episodes"]
    assert "s left" in lines[0] and "100 %" in lines[-1] and "left" not in lines[-1]


def test_a_throttled_bar_reports_only_its_completion():
    assert [line.split(" (")[0] for line in _run(50, 50, every_s=3600)] == ["eval: 50/50 episodes"]
    assert _run(50, 49, every_s=3600) == []  # not done, and too soon for another line


def test_bars_outside_a_report_say_nothing_and_a_training_bar_shows_its_loss():
    bar = Progress(2, enabled=False)
    bar.update()
    assert bar.sink is None
    lines: list[str] = []
    with report_to(lines.append, every_s=0):
        train = Progress(2, enabled=False)
        train.update({"loss": 0.25, "samples_per_s_per_gpu": 10.0})
    assert lines == [lines[0]] and lines[0].startswith("train: 1/2 steps (50 %") and "loss 0.2500" in lines[0]
