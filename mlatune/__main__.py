from mlatune.cli import app

app(prog_name="mlatune")
