"""`python -m offload.testing.sim serve --port 8089`: the simulator without the rest of offload's CLI."""

from offload.cli.sim import sim_app

if __name__ == "__main__":
    sim_app(prog_name="python -m offload.testing.sim")
