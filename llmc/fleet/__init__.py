"""Scale-out: one model served by several Triton replicas from a shared model repository.

objectstore.py (the repository: a folder, or an S3 bucket through s3store.py), deploy.py (`llmc
deploy`: a build as the next version, loaded on every replica in turn by rollout.py, with rollback)
and k8s.py (`llmc k8s`: manifests that run the replicas on a repository in object storage). They
change what a fleet serves; the client that spreads requests over its replicas is llmc.client's
(replicas.py).
"""
