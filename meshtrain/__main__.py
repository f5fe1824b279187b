from meshtrain.cli.main import command

command()
