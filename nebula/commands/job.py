"""`nebula job submit|list|stop|logs --site-config CONFIG`: users' jobs at a site (docs/security.md)."""
from __future__ import annotations

import time
from pathlib import Path

from nebula.commands.user import site_arguments, table


def register(sub) -> None:
    parser = sub.add_parser("job", help="submit a job as a user, list, stop and read the logs of your jobs")
    job_sub = parser.add_subparsers(dest="job_command", required=True, metavar="ACTION")
    common = site_arguments()
    p = job_sub.add_parser("submit", parents=[common], help="run this site's stages of a job file in its own "
                           "workspace, with its own short-lived certificates and processes")
    p.add_argument("job", type=Path, help="the job file (TOML); [job].data, if any, names \"dataset:NAME\"")
    p.add_argument("--user", required=True, help="the user the job runs for (authenticates with their secret)")
    p.add_argument("--cert-days", type=float, default=1.0, help="validity of the job's certificates (default 1)")
    p.add_argument("--join", metavar="ID", help="submit this site's half of a job another site's user submitted "
                   "first, under the id it printed (the halves find each other by it)")
    p.set_defaults(func=_submit)
    p = job_sub.add_parser("list", parents=[common], help="your jobs (--user), or every job's record (operator)")
    p.add_argument("--user", help="only this user's jobs; they authenticate")
    p.set_defaults(func=_list)
    for action, func, help_text in (("stop", _stop, "stop one of your jobs (its stages, then its certificates)"),
                                    ("logs", _logs, "the last lines of one of your job's logs")):
        p = job_sub.add_parser(action, parents=[common], help=help_text)
        p.add_argument("id", help="the job's id (`nebula job list --user USER`)")
        p.add_argument("--user", required=True, help="the job's owner (authenticates with their secret)")
        p.set_defaults(func=func)
    p.add_argument("--stage", help="only this stage's log (default: the supervisor's and every stage's)")
    p.add_argument("-n", "--lines", type=int, default=40)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C ends)")


def _site(args):
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.jobs import Site

    return Site.load(args.site_config)


def _secret(args) -> str:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import read_secret

    return read_secret(args.secret_file, prompt=f"secret for {args.user}: ")


def _submit(args) -> int:
    # why here: torch, kept off `nebula --help`
    from nebula.site.submit import submit

    site = _site(args)
    record = submit(site, args.job, args.user, _secret(args), args.cert_days, args.join)
    print(f"job {record['id']} {record['state']} for {record['owner']}: stages "
          f"{', '.join(f'{n} ({a})' for n, a in record['stages'].items())}; workspace {record['dir']}")
    others = [s for s in record["sites"] if s != record["site"]]
    if others and not args.join:
        print(f"its other half at site(s) {', '.join(others)}: there, a user submits the same file with "
              f"`nebula job submit {args.job.name} --join {record['id']} --user USER --site-config SITE.toml`")
    print(f"watch it: nebula job logs {record['id']} --user {args.user} -f --site-config {args.site_config}")
    return 0


def _list(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.security.accounts import Accounts
    from nebula.site.jobs import whole_job

    site = _site(args)
    records = site.records()
    if args.user:
        Accounts(site.ca).authenticate(args.user, _secret(args), "job.list")
        records = [r for r in records if r["owner"] == args.user]
    rows = [("ID", "OWNER", "STATE", "SUBMITTED", "STAGES (the whole job: this site's and the others')")]
    for r in records:
        rows.append((r["id"], r["owner"], r["state"], time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["submitted"])),
                     "; ".join(whole_job(r))))
    print(table(rows))
    return 0


def _stop(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.jobs import stop

    record = stop(_site(args), args.id, args.user, _secret(args))
    print(f"job {record['id']} {record['state']} ({record.get('why', '')}); its certificates are revoked")
    return 0


def _logs(args) -> int:
    # why here: pynacl, kept off `nebula --help`
    from nebula.site.jobs import log_files, logs
    from nebula.site.service import follow

    site, secret = _site(args), _secret(args)
    print(logs(site, args.id, args.user, secret, args.stage, args.lines))
    if args.follow:  # the owner was checked above; following reads the same files on
        follow(log_files(site, args.id, args.stage))
    return 0
