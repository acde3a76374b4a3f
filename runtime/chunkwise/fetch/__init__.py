"""`chunkwise fetch-model URI DIR`: fetch a checkpoint into DIR so that `chunkwise serve --model DIR` loads it.

It runs in the runtime pod's init container. Sources: hf://org/name[@revision] (the Hugging Face Hub, or
HF_ENDPOINT), s3://bucket/prefix (boto3), gs://bucket/prefix (GCS's JSON API) and http(s):// archives.
Every file is downloaded to DIR/.chunkwise-partial/<path>.part, resumed from what is on disk after a
crash or a dropped connection, verified, and only then renamed into place; DIR/.chunkwise-fetch.json is
written last, so its presence means DIR is complete.

Modules: uri.py (parsing), select.py (which files), download.py (resume, retries, checksums),
progress.py, state.py (marker, journal, lock), httpclient.py, one module per source (hf.py, s3.py,
gcs.py, http.py with archive.py), run.py (the fetch), args.py (the command's flags and exit codes).
Nothing here imports torch.
"""
