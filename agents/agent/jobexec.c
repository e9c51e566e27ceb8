/* gpushare-jobexec: a job's last step before its own program, in C (agents/agent/jobexec.py).
 *
 *   gpushare-jobexec ENV_FD CGROUP_PROCS UID GID NPROC NOFILE UMASK -- PROGRAM [ARG...]
 *
 * The node agent starts it in the job's session, work dir and log pipe, with an empty environment. It
 * does what sandbox.Drop does in a forked Python child, in the same order, then runs the job:
 *
 *   1. reads the job's environment from ENV_FD ("K=V" entries, each ended by a NUL byte) and closes it:
 *      the environment never appears on a command line (/proc/PID/cmdline is readable by every user);
 *   2. joins the job's cgroup by writing "0" to CGROUP_PROCS (empty: no cgroup), while still privileged;
 *   3. sets RLIMIT_CORE to 0 and RLIMIT_NOFILE / RLIMIT_NPROC to NOFILE / NPROC (0: unchanged), soft and
 *      hard, never above the hard limit it was given;
 *   4. sets the umask (octal);
 *   5. unless UID is "-": drops every supplementary group, then to GID and UID (real, effective, saved),
 *      and checks that nothing privileged is left;
 *   6. sets no_new_privs;
 *   7. runs PROGRAM with the job's environment, looked up in that environment's PATH when it has no "/"
 *      (as Python's subprocess does: "/bin:/usr/bin" without one).
 *
 * Any step that fails ends it before the job's program runs: exit 126 (a setup step) or 127 (the program
 * could not be run), with one line saying why on stdout (the job's log). Being a separate program lets the
 * agent start it with vfork, where a Python preexec function needs a full fork of the agent (~2 ms more
 * per launch; docs/benchmarks.md, session 24).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define SETUP_FAILED 126
#define NOT_RUN 127
#define ENV_MAX (16 * 1024 * 1024)

static void fail(int code, const char *what, const char *detail) {
    dprintf(STDOUT_FILENO, "[gpushare: %s%s%s]\n", what, detail ? ": " : "", detail ? detail : "");
    _exit(code);
}

static long number(const char *text, long low, long high, const char *what) {
    char *end = NULL;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || end == text || *end || value < low || value > high) fail(SETUP_FAILED, "bad launch argument", what);
    return value;
}

static char **environment_read(int fd) {
    if (lseek(fd, 0, SEEK_SET) < 0) fail(SETUP_FAILED, "could not read the job's environment", strerror(errno));
    size_t size = 0, room = 64 * 1024;
    char *data = malloc(room + 1);
    if (!data) fail(SETUP_FAILED, "could not read the job's environment", "out of memory");
    for (;;) {
        if (size == room) {
            if (room >= ENV_MAX) fail(SETUP_FAILED, "could not read the job's environment", "too large");
            room *= 2;
            data = realloc(data, room + 1);
            if (!data) fail(SETUP_FAILED, "could not read the job's environment", "out of memory");
        }
        ssize_t got = read(fd, data + size, room - size);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) fail(SETUP_FAILED, "could not read the job's environment", strerror(errno));
        if (got == 0) break;
        size += (size_t)got;
    }
    close(fd);
    data[size] = '\0';
    size_t count = 0;
    for (size_t i = 0; i < size; i++) count += data[i] == '\0';
    char **env = calloc(count + 1, sizeof(char *));
    if (!env) fail(SETUP_FAILED, "could not read the job's environment", "out of memory");
    size_t n = 0;
    for (size_t at = 0; at < size && n < count;) {
        env[n++] = data + at;
        at += strlen(data + at) + 1;
    }
    env[n] = NULL;
    return env;
}

static void cgroup_join(const char *procs) {
    int fd = open(procs, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "0", 1) != 1) fail(SETUP_FAILED, "could not join the job's cgroup", strerror(errno));
    close(fd);
}

static void limit(int which, long value) {
    struct rlimit now;
    if (getrlimit(which, &now) != 0) fail(SETUP_FAILED, "could not read a resource limit", strerror(errno));
    rlim_t cap = (rlim_t)value;
    if (now.rlim_max != RLIM_INFINITY && now.rlim_max < cap) cap = now.rlim_max;
    struct rlimit set = {cap, cap};
    if (setrlimit(which, &set) != 0) fail(SETUP_FAILED, "could not set a resource limit", strerror(errno));
}

static void identity_drop(uid_t uid, gid_t gid) {
    if (setgroups(0, NULL) != 0 || setresgid(gid, gid, gid) != 0 || setresuid(uid, uid, uid) != 0)
        fail(SETUP_FAILED, "could not drop to the job's user", strerror(errno));
    uid_t ruid, euid, suid;
    gid_t rgid, egid, sgid;
    if (getresuid(&ruid, &euid, &suid) != 0 || getresgid(&rgid, &egid, &sgid) != 0 || ruid != uid || euid != uid ||
        suid != uid || rgid != gid || egid != gid || sgid != gid || getgroups(0, NULL) != 0)
        fail(SETUP_FAILED, "privileges left after the drop", NULL);  // never run the job with them
}

static const char *path_of(char **env) {
    for (char **e = env; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) return *e + 5;
    return "/bin:/usr/bin";
}

static void run(char **argv, char **env) {
    const char *program = argv[0];
    if (strchr(program, '/')) {
        execve(program, argv, env);
        return;  // errno says why
    }
    const char *dirs = path_of(env);
    int first = 0;  // the first error that is not "not there" (as subprocess reports it), else ENOENT
    size_t length = strlen(program);
    char full[PATH_MAX];
    for (const char *at = dirs;; at++) {
        const char *end = strchrnul(at, ':');
        size_t dir = (size_t)(end - at);
        if (dir + 1 + length < sizeof(full)) {
            if (dir) {
                memcpy(full, at, dir);
                full[dir] = '/';
                memcpy(full + dir + 1, program, length + 1);
            } else {
                memcpy(full, program, length + 1);  // an empty entry: the work dir
            }
            execve(full, argv, env);
            if (errno != ENOENT && errno != ENOTDIR && !first) first = errno;
        }
        if (!*end) break;
        at = end;
    }
    errno = first ? first : ENOENT;
}

int main(int argc, char **argv) {
    if (argc < 10 || strcmp(argv[8], "--") != 0)
        fail(SETUP_FAILED, "usage: gpushare-jobexec ENV_FD CGROUP_PROCS UID GID NPROC NOFILE UMASK -- PROGRAM", NULL);
    int env_fd = (int)number(argv[1], 3, INT_MAX, "ENV_FD");
    const char *procs = argv[2];
    int drop = strcmp(argv[3], "-") != 0;
    uid_t uid = drop ? (uid_t)number(argv[3], 0, INT_MAX, "UID") : 0;
    gid_t gid = drop ? (gid_t)number(argv[4], 0, INT_MAX, "GID") : 0;
    long nproc = number(argv[5], 0, INT_MAX, "NPROC");
    long nofile = number(argv[6], 0, INT_MAX, "NOFILE");
    char *end = NULL;
    long mask = strtol(argv[7], &end, 8);
    if (end == argv[7] || *end || mask < 0 || mask > 0777) fail(SETUP_FAILED, "bad launch argument", "UMASK");

    char **env = environment_read(env_fd);
    if (*procs) cgroup_join(procs);
    limit(RLIMIT_CORE, 0);
    if (nofile) limit(RLIMIT_NOFILE, nofile);
    if (nproc) limit(RLIMIT_NPROC, nproc);
    umask((mode_t)mask);
    if (drop) identity_drop(uid, gid);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail(SETUP_FAILED, "could not set no_new_privs", strerror(errno));
    run(argv + 9, env);
    dprintf(STDOUT_FILENO, "[gpushare: could not start '%s': %s]\n", argv[9], strerror(errno));  // as jobs.launch
    return NOT_RUN;
}
