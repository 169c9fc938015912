"""`oar launch` without the console script:
python launch_scripts/nemo_run_launch.py --config X.yaml [--executor slurm] [--dryrun] [key=value ...]"""
import sys

from megatron_oar.commands.launch import main

sys.exit(main(sys.argv[1:]))
