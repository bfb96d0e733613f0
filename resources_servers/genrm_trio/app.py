"""NeMo Gym entrypoint of genrm-trio: ``gym env start`` runs ``<venv>/bin/python app.py`` here.

Starts ``genrm-trio serve --from-nemo-gym-env``: host, port and the genrm_compare keys come from
the block NeMo Gym launched this process for (NEMO_GYM_CONFIG_DICT, NEMO_GYM_CONFIG_PATH).
"""

import sys

from genrm_trio.cli import main

if __name__ == "__main__":
    main(["serve", "--from-nemo-gym-env", *sys.argv[1:]], prog_name="genrm-trio")
