"""The command line: help everywhere, and one clear error (exit 2) for bad arguments."""
import pytest

from dflash_jax.cli import build_parser, main


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


@pytest.mark.parametrize("argv", [["--help"]] + [[c, "--help"] for c in subcommands()])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: dflash-jax" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["generate", "--method", "ddtree", "hi"], "--draft"),
    (["generate", "--method", "ddtree", "--draft", "x", "--budget", "0", "hi"], "--budget"),
    (["generate", "--max-new-tokens", "0", "hi"], "--max-new-tokens"),
    (["generate", "--stage-times", "hi"], "--stage-times"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--model", "/nonexistent/model.gguf", "hi"], "/nonexistent/model.gguf"),
])
def test_bad_arguments_give_one_clear_error(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err
