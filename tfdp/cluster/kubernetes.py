"""A pod of a Kubernetes indexed Job or JobSet -> the workers of a tfdp job. Pure Python.

Kubeflow's TFJob wrote ``TF_CONFIG`` for every pod; an indexed Job or a JobSet writes nothing of
the kind, so tfdp builds the cluster from what the pod is given. One rule:

    **Kubernetes gives the pod its index (``JOB_COMPLETION_INDEX``) and its hostname
    (``HOSTNAME``), but not the number of pods nor the name of the headless Service; the
    manifest states those in variables, literally or through the downward API, and every
    worker's address is then its stable DNS name ``<hostname>.<subdomain>:<port>``.**

* **When.** This source applies when ``JOB_COMPLETION_INDEX`` is set and ``TFDP_NUM_WORKERS``
  (the number of pods in the training ring, written in the manifest: Kubernetes exposes
  neither a Job's ``parallelism`` nor its ``completions`` to its pods) is more than 1.
  ``TFDP_NUM_WORKERS=1`` is one worker (its pod must be index 0); a pod with an index but no
  ``TFDP_NUM_WORKERS`` is one worker with a note saying what to set (an indexed Job may be a
  batch of independent tasks); ``TFDP_NUM_WORKERS`` above 1 without an index is an error.
* **Indexed Job** (``completionMode: Indexed``, ``parallelism == completions ==
  TFDP_NUM_WORKERS``, pod ``subdomain`` = a headless Service). Rank = ``JOB_COMPLETION_INDEX``.
  Kubernetes names pod ``i``'s host ``<job-name>-<i>``; the job name is ``HOSTNAME`` without its
  ``-<index>`` suffix. ``TFDP_SUBDOMAIN`` (the pod spec's ``subdomain``, i.e. the Service's
  name) is required: a pod cannot read its own subdomain.
* **JobSet** (``JOBSET_NAME`` set). Its replicated job runs ``REPLICATED_JOB_REPLICAS`` Jobs of
  ``TFDP_NUM_WORKERS / REPLICATED_JOB_REPLICAS`` pods each; rank = ``JOB_INDEX * pods_per_job +
  JOB_COMPLETION_INDEX``; host of rank ``r`` = ``<jobset>-<replicated job>-<job index>-<pod
  index>``. ``JOBSET_NAME``, ``REPLICATED_JOB_NAME``, ``JOB_INDEX`` and
  ``REPLICATED_JOB_REPLICAS`` come from the pod's ``jobset.sigs.k8s.io/jobset-name``,
  ``replicatedjob-name``, ``job-index`` and ``replicatedjob-replicas`` annotations through the
  downward API (docs/clusters.md has the manifest). The subdomain is ``TFDP_SUBDOMAIN`` if set
  (``spec.network.subdomain``), else the JobSet's name, JobSet's default. Only the Jobs of one
  replicated job form the ring. ``HOSTNAME`` must equal this pod's computed host, so names
  that do not match what Kubernetes made are an error, not a ring waiting at wrong addresses.
* **Ports.** Every pod has its own IP, so every worker listens on the same port:
  ``TFDP_PORT_BASE`` (default ``DEFAULT_PORT_BASE``, 20000).
* **Addresses.** ``TFDP_ADDRESS_TEMPLATE`` (default ``{hostname}.{subdomain}:{port}``) is
  formatted for every rank with ``{hostname}``, ``{subdomain}``, ``{rank}``, ``{port}`` and
  ``{rank_port}`` (= port + rank): e.g. ``{hostname}.{subdomain}.team-a.svc.cluster.local:{port}``
  for a fully qualified name, or ``127.0.0.1:{rank_port}`` to emulate the pods as processes of
  one host (what tests/test_kubernetes.py does). The addresses must be ``host:port`` and
  pairwise different.
* **Errors.** A missing or malformed variable, or values that contradict each other
  (``JOB_COMPLETION_INDEX=3`` with ``TFDP_NUM_WORKERS=2``), is a ``ClusterConfigError`` naming
  the variable, its value and the fix.

``TF_CONFIG`` (and every source before this one in ``tfdp.cluster.config``) wins when also set.

References:
    Kubernetes: Jobs, "Completion mode" (``JOB_COMPLETION_INDEX``, pod hostname
    ``$(job-name)-$(index)``) and "Job with Pod-to-Pod Communication"; the downward API.
    JobSet (jobset.sigs.k8s.io): labels and annotations, ``spec.network``.
"""

from __future__ import annotations

import re
from typing import Mapping

from tfdp.cluster.errors import ClusterConfigError, fail, parse_address, port_base
from tfdp.cluster.layout import Layout

__all__ = ["INDEXED_JOB", "JOBSET", "INDEX_ENV", "NUM_WORKERS_ENV", "SUBDOMAIN_ENV",
           "ADDRESS_TEMPLATE_ENV", "DEFAULT_ADDRESS_TEMPLATE", "JOBSET_NAME_ENV",
           "REPLICATED_JOB_NAME_ENV", "JOB_INDEX_ENV", "REPLICAS_ENV", "read_layout",
           "single_pod_note"]

INDEXED_JOB = "Kubernetes indexed Job"  # the source names the strategy logs
JOBSET = "JobSet"

INDEX_ENV = "JOB_COMPLETION_INDEX"
NUM_WORKERS_ENV = "TFDP_NUM_WORKERS"
SUBDOMAIN_ENV = "TFDP_SUBDOMAIN"
ADDRESS_TEMPLATE_ENV = "TFDP_ADDRESS_TEMPLATE"
JOBSET_NAME_ENV = "JOBSET_NAME"
REPLICATED_JOB_NAME_ENV = "REPLICATED_JOB_NAME"
JOB_INDEX_ENV = "JOB_INDEX"
REPLICAS_ENV = "REPLICATED_JOB_REPLICAS"

DEFAULT_ADDRESS_TEMPLATE = "{hostname}.{subdomain}:{port}"
_PLACEHOLDERS = ("hostname", "subdomain", "rank", "port", "rank_port")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DOCS = "docs/clusters.md, 'Indexed Job and JobSet'"


def _annotation_fix(variable: str, annotation: str) -> str:
    path = f"metadata.annotations['jobset.sigs.k8s.io/{annotation}']"
    return (f"set {variable} in the container's env from the downward API: valueFrom: "
            f"{{fieldRef: {{fieldPath: \"{path}\"}}}} ({_DOCS})")


def _text(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name, "").strip()


def _integer(environ: Mapping[str, str], origin: str, name: str, minimum: int, fix: str) -> int:
    """``name``'s value as an integer >= ``minimum``; missing or malformed: an error."""
    text = _text(environ, name)
    if not text:
        raise fail(origin, name, environ.get(name), "missing", fix)
    if not text.isdigit() or int(text) < minimum:
        raise fail(origin, name, environ.get(name), f"not an integer >= {minimum}", fix)
    return int(text)


def _hostname(environ: Mapping[str, str], origin: str) -> str:
    host = _text(environ, "HOSTNAME")
    if not host:
        raise fail(origin, "HOSTNAME", environ.get("HOSTNAME"),
                   "unset: tfdp needs the pod's hostname to name its peers",
                   "run in the pod's container, whose runtime sets HOSTNAME, or pass it on "
                   "(env HOSTNAME=$(hostname) python train.py)")
    return host


def _subdomain(environ: Mapping[str, str], origin: str, default: str | None) -> str:
    sub = _text(environ, SUBDOMAIN_ENV) or default
    if not sub:
        raise fail(origin, SUBDOMAIN_ENV, environ.get(SUBDOMAIN_ENV),
                   "missing: a pod cannot read its own subdomain, and the workers' addresses "
                   "are <hostname>.<subdomain>",
                   "set the pod spec's subdomain to the name of a headless Service (clusterIP: "
                   f"None) selecting the Job's pods, and TFDP_SUBDOMAIN to that name ({_DOCS})")
    if not _DNS_LABEL.match(sub):
        raise fail(origin, SUBDOMAIN_ENV if _text(environ, SUBDOMAIN_ENV) else JOBSET_NAME_ENV,
                   sub, "not a DNS label (lower-case letters, digits and '-', at most 63)",
                   "give the headless Service's name, the pod spec's subdomain")
    return sub


def _addresses(environ: Mapping[str, str], origin: str, hosts: list, subdomain: str) -> list:
    """Every rank's ``host:port`` from ``TFDP_ADDRESS_TEMPLATE`` (see the module docstring)."""
    template = environ.get(ADDRESS_TEMPLATE_ENV, "").strip() or DEFAULT_ADDRESS_TEMPLATE
    fix = ("use the placeholders {" + "}, {".join(_PLACEHOLDERS) + "}, e.g. "
           f"{DEFAULT_ADDRESS_TEMPLATE} (the default)")
    base = port_base(environ, span=len(hosts) if "rank_port" in template else 1)
    addresses = []
    for rank, host in enumerate(hosts):
        try:
            address = template.format(hostname=host, subdomain=subdomain, rank=rank, port=base,
                                      rank_port=base + rank)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise fail(origin, ADDRESS_TEMPLATE_ENV, template,
                       f"cannot be formatted ({type(e).__name__}: {e})", fix) from None
        try:
            addresses.append(parse_address(origin, ADDRESS_TEMPLATE_ENV, address))
        except ClusterConfigError as e:
            raise fail(origin, ADDRESS_TEMPLATE_ENV, template,
                       f"gives rank {rank} the address {address!r}, not host:port ({e})",
                       fix) from None
    if len(set(addresses)) != len(addresses):
        raise fail(origin, ADDRESS_TEMPLATE_ENV, template,
                   f"gives several workers one address ({addresses})",
                   "include {hostname} (pods on their own IPs) or {rank_port} (one host)")
    return addresses


def _indexed_job(environ: Mapping[str, str], count: int, index: int):
    """(rank, every rank's hostname, subdomain, note) of an indexed Job's pod."""
    if index >= count:
        raise fail(INDEXED_JOB, INDEX_ENV, environ.get(INDEX_ENV),
                   f"not below {NUM_WORKERS_ENV}={count}: the pods are indexed 0..{count - 1}",
                   f"set {NUM_WORKERS_ENV} to the Job's completions, equal to its parallelism")
    if count == 1:
        return index, [], "", ""
    host = _hostname(environ, INDEXED_JOB)
    suffix = f"-{index}"
    if not host.endswith(suffix) or len(host) == len(suffix):
        raise fail(INDEXED_JOB, "HOSTNAME", host,
                   f"is not <job-name>{suffix}, the hostname Kubernetes gives pod {index} of an "
                   "indexed Job (a pod with hostNetwork: true has the node's)",
                   "turn hostNetwork off, or write TF_CONFIG for every pod")
    job = host[:-len(suffix)]
    return (index, [f"{job}-{i}" for i in range(count)], _subdomain(environ, INDEXED_JOB, None),
            f"Job {job}, pod {index} of {count}")


def _jobset(environ: Mapping[str, str], count: int, index: int):
    """(rank, every rank's hostname, subdomain, note) of a JobSet's pod."""
    jobset = _text(environ, JOBSET_NAME_ENV)
    rjob = _text(environ, REPLICATED_JOB_NAME_ENV)
    if not rjob:
        raise fail(JOBSET, REPLICATED_JOB_NAME_ENV, environ.get(REPLICATED_JOB_NAME_ENV),
                   "missing", _annotation_fix(REPLICATED_JOB_NAME_ENV, "replicatedjob-name"))
    replicas = _integer(environ, JOBSET, REPLICAS_ENV, 1,
                        _annotation_fix(REPLICAS_ENV, "replicatedjob-replicas"))
    job_index = _integer(environ, JOBSET, JOB_INDEX_ENV, 0,
                         _annotation_fix(JOB_INDEX_ENV, "job-index"))
    if job_index >= replicas:
        raise fail(JOBSET, JOB_INDEX_ENV, environ.get(JOB_INDEX_ENV),
                   f"not below {REPLICAS_ENV}={replicas}: the Jobs are indexed 0..{replicas - 1}",
                   "set both from the pod's annotations, as docs/clusters.md shows")
    if count % replicas:
        raise fail(JOBSET, NUM_WORKERS_ENV, environ.get(NUM_WORKERS_ENV),
                   f"not a multiple of {REPLICAS_ENV}={replicas} (the replicated job's Jobs)",
                   f"set {NUM_WORKERS_ENV} to replicas x the Job template's parallelism, "
                   f"e.g. {replicas * max(1, count // replicas)}")
    per_job = count // replicas
    if index >= per_job:
        raise fail(JOBSET, INDEX_ENV, environ.get(INDEX_ENV),
                   f"not below {NUM_WORKERS_ENV}={count} / {REPLICAS_ENV}={replicas} = {per_job} "
                   f"pod(s) per Job: the pods are indexed 0..{per_job - 1}",
                   f"set {NUM_WORKERS_ENV} to replicas x the Job template's parallelism "
                   "(= its completions)")
    rank = job_index * per_job + index
    if count == 1:
        return rank, [], "", ""
    hosts = [f"{jobset}-{rjob}-{j}-{p}" for j in range(replicas) for p in range(per_job)]
    host = _hostname(environ, JOBSET)
    if host != hosts[rank]:
        raise fail(JOBSET, "HOSTNAME", host,
                   f"differs from {hosts[rank]!r}, the host that {JOBSET_NAME_ENV}={jobset!r}, "
                   f"{REPLICATED_JOB_NAME_ENV}={rjob!r}, {JOB_INDEX_ENV}={job_index} and "
                   f"{INDEX_ENV}={index} name",
                   "set those variables from the pod's jobset.sigs.k8s.io annotations as "
                   f"{_DOCS} shows, and turn hostNetwork off (such a pod has the node's "
                   "hostname)")
    return (rank, hosts, _subdomain(environ, JOBSET, jobset),
            f"JobSet {jobset}, replicated job {rjob}: Job {job_index} of {replicas}, "
            f"pod {index} of {per_job}")


def read_layout(environ: Mapping[str, str]) -> Layout | None:
    """The ring of this pod's indexed Job or JobSet, or None when this source does not apply
    (no ``TFDP_NUM_WORKERS``, or one worker); see the module docstring.

    Raises:
        ClusterConfigError: a missing, malformed or contradictory variable, named.
    """
    count_text = _text(environ, NUM_WORKERS_ENV)
    if not count_text:
        return None
    origin = JOBSET if _text(environ, JOBSET_NAME_ENV) else INDEXED_JOB
    count_fix = (f"set {NUM_WORKERS_ENV} to the number of pods that train together (the Job's "
                 "completions = parallelism; for a JobSet, replicas x parallelism)")
    count = _integer(environ, origin, NUM_WORKERS_ENV, 1, count_fix)
    if not _text(environ, INDEX_ENV):
        if count == 1:
            return None
        raise fail(origin, INDEX_ENV, environ.get(INDEX_ENV),
                   f"unset while {NUM_WORKERS_ENV}={count}: this process is not a pod of an "
                   "indexed Job, so it cannot tell its rank",
                   "run the pods as a Job with completionMode: Indexed or as a JobSet "
                   f"({_DOCS}), or unset {NUM_WORKERS_ENV} for a single worker")
    index = _integer(environ, origin, INDEX_ENV, 0,
                     "run the pods as a Job with completionMode: Indexed; Kubernetes sets it")
    if origin == JOBSET:
        rank, hosts, subdomain, note = _jobset(environ, count, index)
    else:
        rank, hosts, subdomain, note = _indexed_job(environ, count, index)
    if count == 1:
        return None
    return Layout.of_workers(_addresses(environ, origin, hosts, subdomain), rank, origin,
                             notes=(note,))


def single_pod_note(environ: Mapping[str, str]) -> str | None:
    """What to say when a pod of an indexed Job has no ``TFDP_NUM_WORKERS``, else None."""
    index = _text(environ, INDEX_ENV)
    if not index or _text(environ, NUM_WORKERS_ENV):
        return None
    return (f"a pod of a Kubernetes indexed Job ({INDEX_ENV}={index}) without "
            f"{NUM_WORKERS_ENV}: one worker. Set {NUM_WORKERS_ENV} to the number of pods to "
            "train them as one job")
