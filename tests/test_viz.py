"""``oar viz``: token-importance maps (HTML + PNG) from hand-built token records (no model)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser

import pytest
from PIL import Image

from megatron_oar.eval.records import TokenRecord, write_records
from megatron_oar.eval.viz import cells, cli, colors, html_page, inputs, png_figure

TRICKY = ["Let", "'s", " solve", " <b>&", " 3x", " +", " 5", " =", " 20", ".\n", "\n", "<0xE2>",
          "  two spaces", "\t", "&amp;", ' "q"', "x", " =", " 5", " \\boxed{5}"]


def record(tokens=TRICKY, *, id="math500/17#3", scores=None, oracle="auto", scored=None,
           correct=True) -> TokenRecord:
    n = len(tokens)
    if scores is None:
        scores = {"oar_p": [float(i % 7) for i in range(n)],
                  "oar_g": [float((3 * i) % 5) + 0.5 for i in range(n)],
                  "entropy": [1.0 / (i + 1) for i in range(n)]}
    if oracle == "auto":
        oracle = [1 if i in (4, 8, 18) else 0 for i in range(n)]
    return TokenRecord(id=id, prompt="Solve 3x + 5 = 20.\nPut the answer in \\boxed{}.",
                       reference="5", correct=correct, token_ids=list(range(n)),
                       tokens=list(tokens), scores=scores, scored=scored, oracle=oracle)


class Page(HTMLParser):
    """Per panel (``data-method``): the tokens' text and attributes; and every start tag seen."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.panels: dict[str, list[dict]] = {}
        self.tags: Counter = Counter()
        self._panel: str | None = None
        self._tok: dict | None = None
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        a = dict(attrs)
        if tag == "div" and "data-method" in a:
            self._panel = a["data-method"]
            self.panels[self._panel] = []
        elif tag == "span" and "t" in (a.get("class") or "").split():
            assert self._panel is not None and self._tok is None, "stray or nested token span"
            self._tok = {"text": "", "class": a["class"].split(), "style": a.get("style", ""),
                         "title": a.get("title", "")}

    def handle_endtag(self, tag):
        if tag == "span" and self._tok is not None:
            self.panels[self._panel].append(self._tok)
            self._tok = None

    def handle_data(self, data):
        if self._tok is not None:
            self._tok["text"] += data


def bg(tok: dict) -> tuple[int, int, int]:
    value = dict(kv.split(":") for kv in tok["style"].split(";"))["background"]
    return tuple(int(value[i:i + 2], 16) for i in (1, 3, 5))


def methods_of(rec):
    return inputs.resolve_methods(rec, None, "test")


# ----------------------------------------------------------------------------- HTML

def test_html_has_every_token_once_per_panel_in_order():
    rec = record()
    page = Page(html_page.render_html([(rec, methods_of(rec))]))
    assert list(page.panels) == ["oar_p", "oar_g", "entropy", "oracle"]
    expected = [cells.display_text(t) for t in rec.tokens]
    assert expected == rec.tokens  # nothing here needs escaping beyond HTML
    for method, toks in page.panels.items():
        assert [t["text"] for t in toks] == expected, method
        assert all(t["title"] for t in toks)
    # the panels are labelled like the paper's rows
    html = html_page.render_html([(rec, methods_of(rec))])
    for label in ("OAR-P", "OAR-G", "Entropy", "Oracle"):
        assert f'<div class="label">{label}</div>' in html
    assert "white-space:pre-wrap" in html and "<script" not in html and "http" not in html


def test_markup_in_tokens_is_escaped_not_parsed():
    rec = record()
    html = html_page.render_html([(rec, methods_of(rec))])
    assert "&lt;b&gt;&amp;" in html and "<b>" not in html
    page = Page(html)
    assert page.tags["b"] == 0  # the token did not become an element
    assert set(page.tags) <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "div",
                              "span", "small", "section", "code", "details", "summary", "pre", "p"}
    # the tooltip names the raw token and score, quotes escaped inside the attribute
    tok = page.panels["oar_p"][3]
    assert tok["text"] == " <b>&" and "' <b>&'" in tok["title"] and "rank" in tok["title"]


def test_control_characters_are_shown_escaped():
    rec = record(["a\x00b", "\r\n", "\ud800"], oracle=None)
    page = Page(html_page.render_html([(rec, ["oar_p"])]))
    assert [t["text"] for t in page.panels["oar_p"]] == ["a\\x00b", "\\x0d\n", "\ufffd"]


def test_colours_are_monotone_in_the_score():
    n = 12
    scores = [float(i) for i in range(n)]
    rec = record([f" t{i}" for i in range(n)], scores={"oar_p": scores}, oracle=None)
    toks = Page(html_page.render_html([(rec, ["oar_p"])])).panels["oar_p"]
    lum = [colors.luminance(bg(t)) for t in toks]
    assert all(a > b for a, b in zip(lum, lum[1:])), lum  # higher score -> darker
    assert bg(toks[0]) == (255, 255, 255)  # the sequence's minimum is white
    sat = [max(c) - min(c) for c in map(bg, toks)]
    assert sat[-1] > 100 and sat[-1] > sat[0]
    # the colormap itself, on a fine grid; text colour keeps contrast
    grid = [colors.luminance(colors.score_rgb(i / 200)) for i in range(201)]
    assert all(a >= b for a, b in zip(grid, grid[1:])) and grid[0] > 0.99 > 0.1 > grid[-1]
    assert colors.text_rgb(colors.score_rgb(1.0)) == colors.LIGHT_FG
    assert colors.text_rgb(colors.score_rgb(0.0)) == colors.DARK_FG


def test_normalisation_is_oar_eq14_per_sequence():
    torch = pytest.importorskip("torch")
    from megatron_oar.algorithms.oar import normalize_importance

    scores = [0.0, 0.5, 3.0, 100.0, 2.0, 7.0]
    mask = [True, True, True, False, True, True]
    ours = cells.normalize(scores, mask)
    ref = normalize_importance(torch.tensor([scores], dtype=torch.float64), torch.tensor([mask]))[0]
    for i, m in enumerate(mask):
        assert (ours[i] == pytest.approx(float(ref[i]), abs=1e-9)) if m else ours[i] != ours[i]
    # scale-invariant comparability: the same ranking in two methods gives the same end colours
    assert cells.normalize([1, 2, 3], [True] * 3)[0] == 0.0
    assert cells.normalize([5, 5, 5], [True] * 3).tolist() == [0.0, 0.0, 0.0]  # constant: no NaN


def test_unscored_tokens_are_grey_and_unranked():
    scored = [i < len(TRICKY) - 3 for i in range(len(TRICKY))]
    rec = record(scored=scored)
    toks = Page(html_page.render_html([(rec, methods_of(rec))])).panels["oar_p"]
    for t, s in zip(toks, scored):
        assert (bg(t) == colors.UNSCORED_BG) == (not s)
        assert ("not scored" in t["title"]) == (not s)
    ranks = cells.ranks(rec.scores["oar_p"], scored)
    assert sorted(r for r in ranks if r) == list(range(1, sum(scored) + 1))


def test_oracle_row_marks_pivots():
    rec = record()
    page = Page(html_page.render_html([(rec, methods_of(rec))]))
    for tok, o in zip(page.panels["oracle"], rec.oracle):
        assert (bg(tok) == colors.PIVOT_RGB) == bool(o)
        assert ("causal pivot" in tok["title"]) == bool(o)
    for tok, o in zip(page.panels["oar_p"], rec.oracle):  # underlined in the method rows
        assert ("pv" in tok["class"]) == bool(o)
    # the pivot colour is not a colour of the importance ramp
    assert all(colors.score_rgb(i / 50) != colors.PIVOT_RGB for i in range(51))


def test_caption_recall_and_page_metadata():
    n = 10
    rec = record([f" w{i}" for i in range(n)], oracle=[1, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                 scores={"oar_p": [9, 0, 0, 0, 0, 0, 0, 0, 1, 0], "entropy": [0.0] * 9 + [5.0]})
    assert cells.top_recall(rec, "oar_p") == (2, 2, 2)  # top 20% of 10: tokens 0 and 8, both pivots
    assert cells.top_recall(rec, "entropy") == (1, 2, 2)  # 9, then 0 by stable tie order
    html = html_page.render_html([(rec, ["oar_p", "entropy", "oracle"])])
    assert "OAR-P 2/2 = 1.00" in html and "Entropy 1/2 = 0.50" in html
    assert "top 20% = 2 of 10 scored tokens, 2 pivots" in html
    assert "✓ correct" in html and "<details" in html and "linear-gradient" in html
    rec.oracle = None
    assert cells.top_recall(rec, "oar_p") is None
    assert "oracle not run" in html_page.render_html([(rec, ["oar_p"])])


def test_newline_tokens_get_a_visible_marker():
    rec = record(["a", "\n", " b"], oracle=None)
    toks = Page(html_page.render_html([(rec, ["oar_p"])])).panels["oar_p"]
    assert ["nl" in t["class"] for t in toks] == [False, True, False]
    assert toks[1]["text"] == "\n"  # the marker is CSS-generated, not in the text


# ----------------------------------------------------------------------------- PNG

def box_colour(img: Image.Image, box: png_figure.Box) -> tuple[int, int, int]:
    """The most common colour inside a token box: its background (text glyphs are a minority)."""
    crop = img.crop((int(box.x0) + 1, int(box.y0) + 1, int(box.x1) - 1, int(box.y1) - 1))
    return Counter(crop.getdata()).most_common(1)[0][0]


def test_png_renders_with_the_html_colours(tmp_path):
    rec = record()
    methods = methods_of(rec)
    fig, boxes = png_figure.png_figure(rec, methods)
    out = png_figure.render_png(rec, methods, tmp_path / "r.png")
    img = Image.open(out).convert("RGB")
    assert img.width == png_figure.PNG_WIDTH and 300 < img.height < 3000
    assert len(set(img.getdata())) > 20  # not blank
    # the top-scoring OAR-P token is drawn dark red, exactly the HTML's colour
    top = max(range(len(rec.tokens)), key=lambda i: rec.scores["oar_p"][i])
    colours = cells.cell_colors(rec, "oar_p")
    page = Page(html_page.render_html([(rec, methods)]))
    assert bg(page.panels["oar_p"][top]) == colours[top][0]
    top_boxes = [b for b in boxes if b.method == "oar_p" and b.token == top]
    assert top_boxes and all(b.rgb == colours[top][0] for b in top_boxes)
    got = box_colour(img, top_boxes[0])
    assert all(abs(g - e) <= 3 for g, e in zip(got, colours[top][0])), (got, colours[top][0])
    assert colors.luminance(got) < 0.15
    # oracle pivots are blue in the oracle row
    pivot = next(b for b in boxes if b.method == "oracle" and rec.oracle[b.token])
    assert box_colour(img, pivot) == colors.PIVOT_RGB
    # every box lies inside the image
    assert all(0 <= b.x0 < b.x1 <= img.width and 0 <= b.y0 < b.y1 <= img.height for b in boxes)


def test_png_wraps_long_responses_and_grows(tmp_path):
    short = record([" word"] * 20, scores={"oar_p": [float(i) for i in range(20)]}, oracle=None)
    long = record([" word"] * 2000, scores={"oar_p": [float(i % 97) for i in range(2000)]},
                  oracle=None)
    h_short = Image.open(png_figure.render_png(short, ["oar_p"], tmp_path / "s.png")).height
    _, boxes = png_figure.png_figure(long, ["oar_p"])
    h_long = Image.open(png_figure.render_png(long, ["oar_p"], tmp_path / "l.png")).height
    assert h_long > 5 * h_short
    assert len({b.y0 for b in boxes}) > 50  # many lines
    assert max(b.x1 for b in boxes) <= png_figure.PNG_WIDTH - png_figure.MARGIN + 1


def test_wrap_layout():
    segs, nlines = png_figure.wrap(["ab", " cd", "\n", "efghij", "k\nl"], cols=5)
    assert segs[0] == [(0, 0, 2, "ab")] and segs[1] == [(0, 2, 3, " cd")]
    assert segs[2] == []  # a bare newline only breaks the line
    assert segs[3] == [(1, 0, 5, "efghi"), (2, 0, 1, "j")]  # wider than a line: broken
    assert segs[4] == [(2, 1, 1, "k"), (3, 0, 1, "l")] and nlines == 4
    segs, _ = png_figure.wrap(["abcd", "xyz"], cols=5)  # does not fit the rest of the line: next line
    assert segs[1] == [(1, 0, 3, "xyz")]
    segs, _ = png_figure.wrap(["中文"], cols=3)  # wide characters take two columns
    assert segs[0] == [(0, 0, 2, "中"), (1, 0, 2, "文")]


# ----------------------------------------------------------------------------- what a person sees

def _screenshot(html_path, png_path) -> str | None:
    """Renders the page with a headless Chromium; returns None when no browser is installed."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        exe = shutil.which(name)
        if exe:
            subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--screenshot={png_path}", "--window-size=1200,900",
                            html_path.as_uri()], check=True, timeout=120, capture_output=True)
            return exe
    if importlib.util.find_spec("playwright") is not None:
        from playwright.sync_api import Error, sync_playwright

        with sync_playwright() as p:
            try:
                browser = p.chromium.launch()
            except Error:
                return None  # playwright without its browsers
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(html_path.as_uri())
            page.screenshot(path=str(png_path))
            browser.close()
            return "playwright chromium"
    return None


def test_browser_screenshot_is_not_blank(tmp_path):
    rec = record()
    paths = cli.visualize(_write(tmp_path, [rec]), tmp_path / "out", index=0, png=False)
    shot = tmp_path / "shot.png"
    if _screenshot(paths[0], shot) is None:
        if os.environ.get("OAR_REQUIRE_BROWSER") == "1":  # .ci/run installs Debian's chromium
            pytest.fail("OAR_REQUIRE_BROWSER=1 but no headless browser was found (chromium not on PATH)")
        pytest.skip("no headless browser installed (chromium/chromium-browser/google-chrome not on "
                    "PATH, no playwright browsers); not downloading one")
    img = Image.open(shot).convert("RGB")
    pixels = set(img.getdata())
    assert len(pixels) > 50
    assert any(p[0] > 120 and p[1] < 60 and p[2] < 60 for p in pixels)  # dark red: top tokens
    assert any(abs(p[0] - 33) < 10 and abs(p[1] - 102) < 10 and abs(p[2] - 172) < 10
               for p in pixels)  # blue: oracle pivots


# ----------------------------------------------------------------------------- CLI

def _write(tmp_path, recs):
    return write_records(recs, tmp_path / "records.jsonl")


def test_cli_writes_html_and_png(tmp_path, capsys):
    path = _write(tmp_path, [record(), record(id="aime/1#0", correct=False)])
    out = tmp_path / "viz"
    assert cli.main([str(path), "--id", "aime/1#0", "--out", str(out),
                     "--methods", "OAR-G,oracle,entropy"]) == 0
    assert capsys.readouterr().out.split() == [str(out / "aime_1_0.html"),
                                               str(out / "aime_1_0.png")]
    page = Page((out / "aime_1_0.html").read_text(encoding="utf-8"))
    assert list(page.panels) == ["oar_g", "oracle", "entropy"]
    assert Image.open(out / "aime_1_0.png").width == png_figure.PNG_WIDTH
    # several records: one page with a section each, one PNG each
    assert cli.main([str(path), "--out", str(out), "--max-records", "2"]) == 0
    html = (out / "records.html").read_text(encoding="utf-8")
    assert html.count('<section class="record"') == 2 and "✗ incorrect" in html
    assert (out / "math500_17_3.png").is_file()


@pytest.mark.parametrize("args, needle", [
    (["{missing}"], "no such records file"),
    (["{path}", "--id", "nope"], "--id 'nope': no record with that id in {path}"),
    (["{path}", "--index", "5"], "--index 5: {path} has only 2 records"),
    (["{path}", "--index", "1", "--methods", "oar_p,random"],
     "--methods: record 'b' in {path} has no 'random'"),
    (["{path}", "--index", "1", "--methods", "oracle"],
     "--methods: record 'b' in {path} has no oracle"),
])
def test_cli_errors_name_the_file_or_flag(tmp_path, capsys, args, needle):
    path = _write(tmp_path, [record(id="a"), record(id="b", oracle=None)])
    missing = tmp_path / "missing.jsonl"
    fmt = {"path": path, "missing": missing}
    assert cli.main([a.format(**fmt) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oar viz: error: ") and needle.format(**fmt) in err
    if "missing" in args[0]:
        assert str(missing) in err
