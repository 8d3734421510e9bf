"""The report as one self-contained HTML page: inline CSS and JS, thumbnails as data URIs, nothing fetched.

The page's Content-Security-Policy forbids every network load, so it shows the same offline, from a
laptop, or attached to a ticket. Filters (check, stage, text search) run in the page on the cards'
data attributes.
"""

from __future__ import annotations

from html import escape

from batchvlm.review.distributions import Distribution
from batchvlm.review.report import Card, Report

MAX_LINEAGE_ROWS = 500
SEARCHABLE_TEXT = 2000  # characters of a record's text that the search sees

CSS = """
:root{--bad:#b3261e;--ink:#1d1d1f;--mute:#6b6b70;--line:#dcdce0;--bg:#f6f6f8;--ok:#1b7f3b}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,sans-serif;color:var(--ink);background:var(--bg)}
header,section{max-width:1200px;margin:0 auto;padding:12px 20px}h1{font-size:22px;margin:8px 0 0}
h2{font-size:17px;margin:18px 0 8px}h4{margin:6px 0 2px;font-size:12px;color:var(--mute);text-transform:uppercase}
.path{color:var(--mute);margin:2px 0}.totals{display:flex;gap:12px;flex-wrap:wrap}
.tile{background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 16px;min-width:140px}
.tile b{display:block;font-size:24px}.tile.bad b{color:var(--bad)}
.chart button{display:grid;grid-template-columns:260px 1fr 70px;gap:8px;align-items:center;width:100%;
 border:0;background:none;padding:3px 0;cursor:pointer;text-align:left;font:inherit}
.chart .bar{height:16px;background:var(--bad);border-radius:3px;min-width:2px}.chart .n{text-align:right}
.chart button:hover .bar{opacity:.75}.tables{display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:16px}
table{border-collapse:collapse;width:100%;background:#fff;border:1px solid var(--line)}
td,th{padding:4px 8px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top;word-break:break-all}
td.n,th{white-space:nowrap;word-break:normal}td.n{text-align:right}.fixed{color:var(--ok);font-weight:600}.still{color:var(--bad)}
.filters{display:flex;gap:12px;flex-wrap:wrap;align-items:center;position:sticky;top:0;background:var(--bg);padding:8px 0;z-index:1}
.filters input{min-width:280px;padding:4px 8px}.filters select{padding:3px}#shown{color:var(--mute)}
.card{display:grid;grid-template-columns:minmax(200px,auto) 1fr;gap:16px;background:#fff;border:1px solid var(--line);
 border-left:4px solid var(--bad);border-radius:8px;padding:12px;margin:10px 0}
.thumbs{display:flex;flex-direction:column;gap:8px}.thumb{margin:0;width:200px}
.thumb img{max-width:192px;max-height:192px;display:block;background:repeating-conic-gradient(#ddd 0 25%,#fff 0 50%) 0/16px 16px}
.thumb.failed img,.thumb.failed .placeholder{outline:3px solid var(--bad)}
.placeholder{width:192px;height:120px;display:flex;align-items:center;justify-content:center;text-align:center;
 padding:8px;background:repeating-linear-gradient(45deg,#eee 0 8px,#f8f8f8 8px 16px);color:var(--mute);font-size:12px}
figcaption{font-size:12px;color:var(--mute)}.id{margin:0;font-size:16px;word-break:break-all}
.badge{display:inline-block;border-radius:10px;padding:1px 8px;font-size:12px;background:#eee}
.badge.check{background:#fde7e5;color:var(--bad);font-weight:600}.message{font-weight:500}
.eo{display:grid;grid-template-columns:1fr 1fr;gap:10px}
pre{margin:0;white-space:pre-wrap;word-break:break-word;background:var(--bg);padding:6px;border-radius:4px;font-size:12px}
mark{background:#ffe08a;border-radius:2px}h4.plain{text-transform:none}.more{color:var(--mute);font-style:italic;margin:6px 0 14px}
[hidden]{display:none!important}
.turn{display:grid;grid-template-columns:90px 1fr;gap:8px;margin:4px 0}.badge.role{background:#e6eefb;color:#24508f}
.turn[data-role=assistant] .badge.role{background:#e5f4ea;color:var(--ok)}
.cut{color:var(--bad);font-weight:600;margin:6px 0}
.hists{display:grid;grid-template-columns:repeat(auto-fit,minmax(340px,1fr));gap:16px}
.hist{margin:0;background:#fff;border:1px solid var(--line);border-radius:8px;padding:10px 12px}
.hist h3{margin:0;font-size:15px}.hist div{display:grid;grid-template-columns:130px 1fr 60px;gap:8px;align-items:center}
.hist .bar{height:12px;background:#3b6fb6;border-radius:2px}.hist .n{text-align:right}
"""

JS = """
const cards = [...document.querySelectorAll('#cards > [data-check]')];
const total = cards.filter(el => el.classList.contains('card')).length;
const byId = id => document.getElementById(id);
function apply() {
  const check = byId('filter-check').value, stage = byId('filter-stage').value;
  const query = byId('search').value.trim().toLowerCase();
  let shown = 0;
  for (const el of cards) {
    const keep = (!check || el.dataset.check === check) && (!stage || el.dataset.stage === stage)
      && (!query || (el.dataset.search || '').includes(query));
    el.hidden = !keep;
    if (keep && el.classList.contains('card')) shown++;
  }
  byId('shown').textContent = `${shown} of ${total} cards shown`;
}
for (const id of ['filter-check', 'filter-stage']) byId(id).addEventListener('change', apply);
byId('search').addEventListener('input', apply);
for (const bar of document.querySelectorAll('.chart button')) bar.addEventListener('click', () => {
  byId('filter-check').value = bar.dataset.check; apply(); byId('cards-section').scrollIntoView();
});
apply();
"""

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def render(report: Report) -> str:
    title = f"Quarantine report: {report.run_dir.name}"
    parts = [f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
             f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
             f'<meta name="viewport" content="width=device-width"><title>{escape(title)}</title>'
             f"<style>{CSS}</style></head><body>",
             f'<header><h1>{escape(title)}</h1><p class="path">{escape(str(report.run_dir))}'
             f'{"" if report.complete else " — NOT COMPLETE: some units are not committed"}</p></header>',
             _totals(report), _chart(report), _tables(report), _written_data(report), _requeue(report),
             _cards(report),
             f"<script>{JS}</script></body></html>"]
    return "\n".join(parts)


def _totals(report: Report) -> str:
    share = f"{report.quarantined / report.records_in:.1%}" if report.records_in else "0%"
    tiles = [("records in", report.records_in, ""), ("written", report.written, ""),
             (f"quarantined ({share})", report.quarantined, "bad"), ("fallbacks taken", report.fallbacks.total(), "")]
    return '<section class="totals">' + "".join(
        f'<div class="tile {kind}"><b>{value:,}</b>{escape(label)}</div>' for label, value, kind in tiles) + "</section>"


def _chart(report: Report) -> str:
    if not report.by_check:
        return "<section><h2>Failures by check</h2><p>Nothing was quarantined.</p></section>"
    top = max(report.by_check.values())
    bars = "".join(f'<button type="button" data-check="{escape(check)}" title="show only {escape(check)}">'
                   f'<span>{escape(check)}</span><span class="bar" style="width:{100 * count / top:.1f}%"></span>'
                   f'<span class="n">{count:,}</span></button>' for check, count in report.by_check.most_common())
    return f'<section class="chart" id="chart"><h2>Failures by check</h2>{bars}</section>'


def _table(title: str, header: str, rows: list[tuple[str, int]]) -> str:
    body = "".join(f'<tr><td>{escape(key)}</td><td class="n">{count:,}</td></tr>' for key, count in rows)
    return f"<div><h2>{escape(title)}</h2><table><tr><th>{escape(header)}</th><th>records</th></tr>{body}</table></div>"


def _tables(report: Report) -> str:
    messages = [(f"[{check}] {message}", count) for (check, message), count in report.messages.most_common(10)]
    return ('<section class="tables">' + _table("By stage", "stage", report.by_stage.most_common())
            + _table("By source file", "file", report.by_source.most_common())
            + _table("Most frequent messages", "message", messages) + "</section>")


def _written_data(report: Report) -> str:
    figures = "".join(_histogram(distribution) for distribution in report.written_data)
    records, turns = report.cut_conversations
    cut = (f'<p class="cut">{records:,} conversations cut to whole turns (text.overflow=drop_turns): {turns:,} '
           "trailing turns left out</p>") if records else ""
    return ('<section id="written-data"><h2>Written data</h2><p class="path">Committed records, for choosing '
            'training settings (token budget, sequence length, resize limits).</p>'
            f'{cut}<div class="hists">{figures}</div></section>')


def _histogram(distribution: Distribution) -> str:
    title = f"<h3>{escape(distribution.title)}</h3>"
    if not distribution.total:
        return f'<figure class="hist">{title}<p class="path">none</p></figure>'
    rows = distribution.histogram()
    top = max(count for _, _, count in rows)
    bars = "".join(f'<div><span>{escape(distribution.label(low, high))}</span><span class="bar" '
                   f'style="width:{100 * count / top:.1f}%"></span><span class="n">{count:,}</span></div>'
                   for low, high, count in rows)
    quantiles = " · ".join(f"{name} {value}" for name, value in distribution.percentiles())
    return (f'<figure class="hist">{title}<p class="path">{quantiles} · {distribution.total:,} {distribution.per}</p>'
            f"{bars}</figure>")


def _requeue(report: Report) -> str:
    outcome = report.requeue
    if outcome is None:
        return ""
    rows = ([(e, '<span class="fixed">fixed: now in data/</span>') for e in outcome.fixed]
            + [(e, f'<span class="still">still quarantined: {escape(e["now_check"])}</span>')
               for e in outcome.still_quarantined]
            + [(e, '<span class="still">not found in the dataset</span>') for e in outcome.not_found])
    body = "".join(f'<tr data-requeued="{escape(entry["id"])}"><td>{escape(entry["id"])}</td>'
                   f'<td>{escape(entry["check"])}</td><td>{status}</td></tr>' for entry, status in rows[:MAX_LINEAGE_ROWS])
    rest = len(rows) - MAX_LINEAGE_ROWS
    more = f'<p class="more">{rest:,} more requeued records not listed (see lineage.json)</p>' if rest > 0 else ""
    return (f'<section id="requeue"><h2>Requeue of {escape(outcome.requeue_from)}</h2>'
            f"<p>{len(outcome.fixed):,} fixed, {len(outcome.still_quarantined):,} still quarantined, "
            f"{len(outcome.not_found):,} not found.</p><table><tr><th>id</th><th>quarantined under</th>"
            f"<th>now</th></tr>{body}</table>{more}</section>")


def _options(element_id: str, label: str, values) -> str:
    options = "".join(f'<option value="{escape(v)}">{escape(v)}</option>' for v in values)
    return f'<label>{label} <select id="{element_id}"><option value="">all</option>{options}</select></label>'


def _cards(report: Report) -> str:
    checks = [check for check, _ in report.by_check.most_common()]
    filters = ('<div class="filters">' + _options("filter-check", "Check", checks)
               + _options("filter-stage", "Stage", sorted(report.by_stage))
               + '<input id="search" type="search" placeholder="search id, file, message, text">'
               + '<span id="shown"></span></div>')
    items = []
    for check in checks:
        items += [_card(card, report.placeholder, report.was_check.get(card.row["id"]))
                  for card in report.cards.get(check, [])]
        if (rest := report.cards_not_shown(check)) > 0:
            items.append(f'<p class="more" data-check="{escape(check)}" data-stage="{escape(check.split(".")[0])}">'
                         f"{rest:,} more records quarantined under {escape(check)} are not shown "
                         f"(at most {report.max_cards_per_check} cards per check; all are in quarantine/)</p>")
    return (f'<section id="cards-section"><h2>Quarantined records</h2>{filters}'
            f'<div id="cards">{"".join(items)}</div></section>')


def _card(card: Card, placeholder: str, was_check: str | None) -> str:
    row = card.row
    searchable = " ".join(str(row[k] or "") for k in ("id", "source", "check", "message", "exception_type"))
    searchable += " " + (row["text"] or "")[:SEARCHABLE_TEXT]
    images = len(row["image_paths"] or [])  # one entry per image, None where the bytes were inline
    thumbnails = "".join(_thumbnail(card, i) for i in range(len(card.thumbnails)))
    if images == 0:
        thumbnails = '<div class="placeholder">text only: no image</div>'
    return (f'<article class="card" data-check="{escape(row["check"])}" data-stage="{escape(row["stage"])}" '
            f'data-search="{escape(searchable.lower())}">'
            f'<div class="thumbs">{thumbnails}</div>'
            f'<div class="body"><h3 class="id">{escape(row["id"])}</h3>'
            f'<p class="where">{escape(row["source"])} : {escape(card.place)} · unit {escape(row["unit"])}</p>'
            f'<p><span class="badge check">{escape(row["check"])}</span> <span class="badge">{escape(row["stage"])}</span> '
            f'<span class="badge">{escape(row["exception_type"] or "")}</span>'
            f'{_failed_image(row)}{_was(was_check)}</p><p class="message">{escape(row["message"])}</p>'
            f'<div class="eo"><div><h4>expected</h4><pre>{escape(row["expected"])}</pre></div>'
            f'<div><h4>observed</h4><pre>{escape(row["observed"])}</pre></div></div>'
            f"{_text(row, placeholder, images)}</div></article>")


def _text(row: dict, placeholder: str, images: int) -> str:
    """A plain text with its placeholders marked, or a conversation turn by turn: each role, and where the failure is
    (text.too_long: the turn where text.max_tokens is reached, the cut)."""
    turns = row.get("turns")
    if turns is None:
        text = row["text"] or ""
        return (f'<h4 class="plain">text: {text.count(placeholder)} × {escape(placeholder)} for {images} image(s)</h4>'
                f"<pre>{_highlight(text, placeholder)}</pre>")
    shown = sum(turn["text"].count(placeholder) for turn in turns)
    items = []
    for index, turn in enumerate(turns):
        if index == row.get("turn_index"):
            mark = ("✂ text.max_tokens is reached in this turn: the conversation would be cut here"
                    if row["check"] == "text.too_long" else "▶ the failure is about this turn")
            items.append(f'<p class="cut">{mark}</p>')
        items.append(f'<div class="turn" data-role="{escape(turn["role"])}"><span class="badge role">'
                     f'{escape(turn["role"])}</span><pre>{_highlight(turn["text"], placeholder)}</pre></div>')
    return (f'<h4 class="plain">conversation: {len(turns)} turn(s), {shown} × {escape(placeholder)} for {images} '
            f'image(s)</h4><div class="turns">{"".join(items)}</div>')


def _was(check: str | None) -> str:
    """On a requeue run's card: the check the record failed in the run it was requeued from."""
    return "" if check is None else f' <span class="badge was">requeued from {escape(check)}</span>'


def _failed_image(row: dict) -> str:
    return "" if row["image_index"] is None else f' <span class="badge">image {row["image_index"]}</span>'


def _thumbnail(card: Card, index: int) -> str:
    thumbnail = card.thumbnails[index]
    failed = " failed" if card.row["image_index"] == index else ""
    picture = (f'<img class="thumbnail" alt="image {index} of {escape(card.row["id"])}" src="{thumbnail.data_uri}">'
               if thumbnail.data_uri else f'<div class="placeholder">{escape(thumbnail.reason)}</div>')
    facts = " · ".join(f"{key} {escape(value)}" for key, value in thumbnail.facts.items())
    return f'<figure class="thumb{failed}">{picture}<figcaption>image {index}{" (failed)" if failed else ""} · {facts}</figcaption></figure>'


def _highlight(text: str, placeholder: str) -> str:
    """The text escaped, with each placeholder marked (escaping maps occurrences one to one)."""
    marked = escape(placeholder)
    return escape(text).replace(marked, f"<mark>{marked}</mark>")
