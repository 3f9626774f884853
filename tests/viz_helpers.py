"""Helpers of the picture tests: PNG checks (big enough, not blank, showing a colour), an HTML element
collector, and a small hand-made trace whose token text would be markup if it were not escaped."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import numpy as np
from matplotlib import image

from verispec.trace import TokenFate, TokenProbs, Trace


def load_rgb(path: Path) -> np.ndarray:
    """The PNG's pixels as uint8 RGB: [H, W, 3]."""
    pixels = image.imread(path)  # [H, W, 3 or 4], floats in [0, 1] for PNG
    return np.round(pixels[..., :3] * 255).astype(np.uint8)


def assert_picture(path: Path, min_width: int, min_height: int) -> np.ndarray:
    """Assert that ``path`` is a PNG of at least min_width × min_height pixels whose content is not uniform:
    many distinct colours, and no single colour covering 99% of it. Returns its RGB pixels."""
    assert path.stat().st_size > 2000, f"{path} is only {path.stat().st_size} bytes"
    rgb = load_rgb(path)
    height, width, _ = rgb.shape
    assert width >= min_width and height >= min_height, f"{path} is {width}×{height}"
    colours, counts = np.unique(rgb.reshape(-1, 3), axis=0, return_counts=True)
    assert len(colours) >= 16, f"{path} has only {len(colours)} colours"
    assert counts.max() < 0.99 * width * height, f"{path} is almost one colour"
    return rgb


def has_colour(rgb: np.ndarray, hex_colour: str, tolerance: int = 12, min_pixels: int = 20) -> bool:
    """Whether at least ``min_pixels`` pixels are within ``tolerance`` of ``hex_colour`` ("#rrggbb")."""
    target = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
    close = np.abs(rgb.astype(int) - target).max(axis=-1) <= tolerance
    return int(close.sum()) >= min_pixels


def toy_trace() -> Trace:
    """Three rounds: an accepted token and a bonus; a rejected draft and its recovery; a bonus token, with
    text that would be markup if it were not escaped."""

    def probs(token_id: int, text: str, q: float | None = 0.5) -> TokenProbs:
        return TokenProbs(token_id=token_id, p=0.25, q=q, text=text)

    tokens = (
        TokenFate(probs(1, "Hel"), "accepted", 0, accept_prob=0.5),
        TokenFate(probs(2, "lo", None), "bonus", 0, accept_prob=None),
        TokenFate(probs(3, ' <img src=x onerror="alert(1)">'), "recovered", 1, 0.1, rejected=probs(4, "&p")),
        TokenFate(probs(5, "\n", None), "bonus", 2, accept_prob=None),
        TokenFate(probs(6, "", None), "bonus", 3, accept_prob=None),
    )
    stats = {
        "new_tokens": 5,
        "target_calls": 4,
        "tokens_per_target_call": 1.25,
        "acceptance_rate": 0.5,
        "accepted": 1,
        "drafted": 2,
        "tokens_per_second": 10.0,
        "drafter": "model",
        "k": "2",
        "stop_reason": "max_new_tokens",
    }
    return Trace(tokens=tokens, stats=stats, prompt="<b>prompt</b>", settings=(("target", "toy"),))


class Elements(HTMLParser):
    """Collects (tag, attributes, text) of every element, and the text inside each span.tok."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict]] = []
        self.token_texts: list[str] = []
        self._in_token = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.elements.append((tag, attributes))
        self._in_token = tag == "span" and "tok" in attributes.get("class", "").split()
        if self._in_token:
            self.token_texts.append("")

    def handle_endtag(self, tag):
        self._in_token = False

    def handle_data(self, data):
        if self._in_token:
            self.token_texts[-1] += data
