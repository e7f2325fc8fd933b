#!/bin/sh
# Run by the postgres image once, on an empty volume (/docker-entrypoint-initdb.d): the role the
# services connect as. It owns the gpulayer database and nothing more (no superuser, no
# CREATEDB, no CREATEROLE), so a stolen connection can't run programs (COPY ... TO PROGRAM) or
# read the server's files. psql takes the password from the environment (\getenv), never from
# a command line, which any process in the container could read.
set -eu
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname postgres <<'SQL'
\getenv password POSTGRES_SERVICES_PASSWORD
CREATE ROLE gpulayer LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'password';
CREATE DATABASE gpulayer OWNER gpulayer;
REVOKE ALL ON DATABASE gpulayer FROM PUBLIC;
SQL
