from bigbatch.app.cli import run

run()
