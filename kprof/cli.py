"""kprof's command line: thin typer commands over the library. (Being built: see README.)"""

import typer

app = typer.Typer(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})


@app.callback()
def _root() -> None:
    """Profile PyTorch training steps on the roofline, suggest fused kernels, patch them in."""


def main() -> None:
    app()
