#!/usr/bin/env bash
# Install (Debian) and start a PostgreSQL server on 127.0.0.1 with a user and database for the server tests.
# Prints the SQLAlchemy URL on stdout (export it as ATORCH_TEST_POSTGRES_URL); fails if it cannot.
set -euo pipefail
DB=${ATORCH_PG_DB:-atorch_test} USER_=${ATORCH_PG_USER:-atorch} PASS=${ATORCH_PG_PASSWORD:-atorch} PORT=${ATORCH_PG_PORT:-5432}
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
if ! command -v pg_lsclusters >/dev/null; then
  as_root apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq postgresql >&2
fi
VERSION=$(pg_lsclusters -h | awk 'NR==1{print $1}')
if [ -z "$VERSION" ]; then
  VERSION=$(ls /usr/lib/postgresql | sort -n | tail -1)
  as_root pg_createcluster "$VERSION" main -p "$PORT" >&2
fi
CLUSTER=$(pg_lsclusters -h | awk 'NR==1{print $2}')
PORT=$(pg_lsclusters -h | awk 'NR==1{print $3}')
if ! pg_lsclusters -h | awk 'NR==1{print $4}' | grep -q online; then
  as_root pg_ctlcluster "$VERSION" "$CLUSTER" start -- -o "-c listen_addresses=127.0.0.1" >&2 \
    || as_root pg_ctlcluster "$VERSION" "$CLUSTER" start >&2
fi
psql_() { as_root su postgres -c "psql -p $PORT -v ON_ERROR_STOP=1 -qAtc \"$1\"" ; }
for _ in $(seq 30); do psql_ "select 1" >/dev/null 2>&1 && break; sleep 1; done
[ "$(psql_ "select 1 from pg_roles where rolname='$USER_'")" = 1 ] || psql_ "create role $USER_ login password '$PASS'" >&2
[ "$(psql_ "select 1 from pg_database where datname='$DB'")" = 1 ] || psql_ "create database $DB owner $USER_" >&2
echo "postgresql+psycopg://$USER_:$PASS@127.0.0.1:$PORT/$DB"
