"""NeMo Gym entrypoint for a genrm-trio started outside NeMo Gym (``genrm-trio serve``).

NeMo Gym 0.7.0 launches every block an agent references; this one serves nothing: the block's
host and port name the external server, which NeMo Gym's clients then call. See
``genrm-trio nemo-gym-external --help``.
"""

import sys

from genrm_trio.cli import main

if __name__ == "__main__":
    main(["nemo-gym-external", *sys.argv[1:]], prog_name="genrm-trio")
