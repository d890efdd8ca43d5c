"""``python -m wf_launch.run``: torchrun's command line on wf_launch
(:mod:`wf_launch.drivers.run`)."""

from wf_launch.drivers.run import main

if __name__ == "__main__":
    main()
