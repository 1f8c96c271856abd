"""Modal screens: the evict confirmation and the key help."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

__all__ = ["ConfirmScreen", "HelpScreen", "HELP"]

# What the help screen lists; kept beside the screen so the two cannot drift apart.
HELP = (
    (
        "Everywhere",
        (
            ("1 / 2 / 3 / 4", "pools · clients & leases · objects · sessions"),
            ("p", "pause / resume the display (snapshots keep arriving)"),
            ("?", "this help"),
            ("q", "quit"),
        ),
    ),
    (
        "Objects",
        (
            ("/", "edit the key filter (a regex, as in kvbroker ls --match)"),
            ("escape", "leave the filter for the table"),
            ("s", "sort by the next column: key, size, age, readers"),
            ("r", "reverse the sort"),
            ("d / delete", "evict the selected object (asks first)"),
        ),
    ),
)


class ConfirmScreen(ModalScreen[bool]):
    """Ask a yes/no question; dismisses with True only on an explicit yes."""

    BINDINGS = [
        Binding("y", "answer(True)", "yes", show=False),
        Binding("n,escape", "answer(False)", "no", show=False),
    ]

    def __init__(self, question: str, confirm_label: str = "Evict") -> None:
        super().__init__()
        self.question = question
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Label(Text(self.question), id="confirm-question")
            with Horizontal(id="confirm-buttons"):
                yield Button(f"{self.confirm_label} (y)", variant="error", id="confirm-yes")
                yield Button("Cancel (n)", variant="primary", id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-no", Button).focus()  # the safe answer is the default

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm-yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close", show=False)]

    def compose(self) -> ComposeResult:
        text = Text()
        width = max(len(key) for _, keys in HELP for key, _ in keys) + 2  # the key column
        for section, keys in HELP:
            text.append(f"{section}\n", "bold")
            for key, what in keys:
                text.append(f"  {key:<{width}}", "bold")
                text.append(f"{what}\n")
            text.append("\n")
        text.append("escape closes this help", "dim")
        with Vertical(id="help-box"):
            yield Static(text)

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "kvbroker tui · keys"
