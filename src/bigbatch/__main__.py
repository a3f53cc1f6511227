from bigbatch.cli import run

run()
