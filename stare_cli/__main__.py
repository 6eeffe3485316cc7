from stare_cli.cli import entry

entry()
