"""`python jobs/report.py run_dir=outputs/<run>`: the failure summary in the terminal and
the run's report page (`<run>/report/index.html`), one self-contained page (see docs/review.md)."""

from __future__ import annotations

from omegaconf import DictConfig

from batchvlm.config import ConfigError, exit_on_config_error, job_main, required_path
from batchvlm.review.report import ReportError, build_report, summary_text
from batchvlm.review.html import render
from batchvlm.rundir.layout import RunLayout


@job_main("report")
def main(cfg: DictConfig) -> None:
    with exit_on_config_error(ReportError):
        run_dir = required_path(cfg, "run_dir", "run_dir=outputs/<run>")
        if cfg.max_cards_per_check < 0:
            raise ConfigError(f"max_cards_per_check={cfg.max_cards_per_check} must be >= 0")
        report = build_report(run_dir, cfg.max_cards_per_check)
    page = RunLayout(run_dir).report_page
    page.parent.mkdir(exist_ok=True)
    page.write_text(render(report), encoding="utf-8")
    print(summary_text(report))
    print(f"page: {page}")


if __name__ == "__main__":
    main()
