// Integration tests of libkvcached against a real kvcached-serve that the
// tests start: on the host backend, or on the CUDA backend with the test
// driver (KVC_TEST_BACKEND=cuda, KVCACHED_LIBCUDA pointing at it).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvcached.h"

extern char **environ;

// The daemon to SIGKILL (and reap) when the next FREE record goes out on an
// fd channel, just before it is sent; -1: none.
static std::atomic<pid_t> g_kill_on_free{-1};
static std::atomic<int> g_killed_on_free{0};

// This program's sendmsg comes before libc's for libkvcached.so too: it
// passes every call on, after killing the daemon of g_kill_on_free when the
// call sends a FREE record (header "KVCF", version, type 7 little-endian).
extern "C" ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
    using sendmsg_fn = ssize_t (*)(int, const struct msghdr *, int);
    static const sendmsg_fn real = reinterpret_cast<sendmsg_fn>(dlsym(RTLD_NEXT, "sendmsg"));
    pid_t pid = g_kill_on_free.load();
    if (pid > 0 && msg && msg->msg_iovlen > 0 && msg->msg_iov[0].iov_len >= 8) {
        const unsigned char *b = static_cast<const unsigned char *>(msg->msg_iov[0].iov_base);
        if (std::memcmp(b, "KVCF", 4) == 0 && b[6] == 7 && b[7] == 0 &&
            g_kill_on_free.compare_exchange_strong(pid, -1)) {
            kill(pid, SIGKILL);
            int st = 0;
            waitpid(pid, &st, 0);
            g_killed_on_free = 1;
        }
    }
    return real(fd, msg, flags);
}

// While set, a session's monitor thread that wakes up (its poll: the
// eventfd and the fd channel with POLLRDHUP) waits before it reads.
static std::atomic<int> g_hold_monitor{0};

extern "C" int poll(struct pollfd *fds, nfds_t nfds, int timeout)
{
    using poll_fn = int (*)(struct pollfd *, nfds_t, int);
    static const poll_fn real = reinterpret_cast<poll_fn>(dlsym(RTLD_NEXT, "poll"));
    int n = real(fds, nfds, timeout);
    if (nfds == 2 && (fds[1].events & POLLRDHUP))
        while (g_hold_monitor.load())
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return n;
}

namespace {

std::string g_backend = "host";
std::string g_serve;   // kvcached-serve
std::string g_python;  // the venv's python
std::string g_helper;  // kvc_test_helper
std::string g_repo;
std::string g_tmp;     // per-run scratch directory

const uint64_t MiB = 1ull << 20;

std::string env_or(const char *name, const char *def)
{
    const char *v = std::getenv(name);
    return v && *v ? v : def;
}

// ---- processes ---------------------------------------------------------

struct Proc {
    pid_t pid = -1;
    int in = -1, out = -1;  // child's stdin (write end), stdout (read end)

    // Start argv with extra "K=V" environment entries; pipes optional.
    bool start(const std::vector<std::string> &argv, const std::vector<std::string> &extra_env,
               bool pipes, const std::string &log_path = "")
    {
        std::vector<std::string> envs;
        for (char **e = environ; *e; e++) {
            std::string kv = *e;
            bool replaced = false;
            for (const auto &x : extra_env)
                if (kv.substr(0, kv.find('=') + 1) == x.substr(0, x.find('=') + 1))
                    replaced = true;
            if (!replaced)
                envs.push_back(kv);
        }
        for (const auto &x : extra_env)
            envs.push_back(x);
        std::vector<char *> av, ev;
        for (const auto &a : argv)
            av.push_back(const_cast<char *>(a.c_str()));
        av.push_back(nullptr);
        for (const auto &e : envs)
            ev.push_back(const_cast<char *>(e.c_str()));
        ev.push_back(nullptr);
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        int pin[2] = {-1, -1}, pout[2] = {-1, -1};
        if (pipes) {
            if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC))
                return false;
            posix_spawn_file_actions_adddup2(&fa, pin[0], 0);
            posix_spawn_file_actions_adddup2(&fa, pout[1], 1);
        }
        if (!log_path.empty()) {
            posix_spawn_file_actions_addopen(&fa, 2, log_path.c_str(),
                                             O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (!pipes)
                posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(),
                                                 O_WRONLY | O_CREAT | O_APPEND, 0644);
        }
        int rc = posix_spawn(&pid, av[0], &fa, nullptr, av.data(), ev.data());
        posix_spawn_file_actions_destroy(&fa);
        if (pipes) {
            close(pin[0]);
            close(pout[1]);
            in = pin[1];
            out = pout[0];
        }
        return rc == 0;
    }

    std::string read_line(int timeout_s = 30)
    {
        std::string line;
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
        char c;
        while (std::chrono::steady_clock::now() < until) {
            ssize_t n = read(out, &c, 1);
            if (n <= 0)
                break;
            if (c == '\n')
                return line;
            line += c;
        }
        return line;
    }

    void write_line(const std::string &s)
    {
        std::string l = s + "\n";
        ssize_t n = write(in, l.data(), l.size());
        (void)n;
    }

    int wait()
    {
        int st = 0;
        if (pid > 0)
            waitpid(pid, &st, 0);
        pid = -1;
        if (in >= 0)
            close(in);
        if (out >= 0)
            close(out);
        in = out = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }

    void kill_and_wait(int sig)
    {
        if (pid > 0)
            kill(pid, sig);
        wait();
    }
};

// Run to completion, capturing stdout.
std::string run(const std::vector<std::string> &argv, const std::vector<std::string> &env,
                int *exit_code)
{
    Proc p;
    if (!p.start(argv, env, true)) {
        *exit_code = -1;
        return "";
    }
    close(p.in);
    p.in = -1;
    std::string all;
    char buf[4096];
    ssize_t n;
    while ((n = read(p.out, buf, sizeof buf)) > 0)
        all.append(buf, n);
    *exit_code = p.wait();
    return all;
}

// ---- the daemon ----------------------------------------------------------

struct Daemon {
    std::string dir, sock, log;
    Proc proc;
    std::vector<std::string> args_, env_;

    // "@STATE@" in extra_args stands for dir/state (for --state-dir).
    void start(const std::vector<std::string> &extra_args = {},
               const std::vector<std::string> &extra_env = {})
    {
        if (dir.empty()) {
            char tmpl[512];
            std::snprintf(tmpl, sizeof tmpl, "%s/daemon.XXXXXX", g_tmp.c_str());
            ASSERT_NE(mkdtemp(tmpl), nullptr);
            dir = tmpl;
        }
        args_ = extra_args;
        env_ = extra_env;
        sock = dir + "/k.sock";
        log = dir + "/daemon.log";
        std::vector<std::string> argv = {g_serve,          "--socket",         sock,
                                         "--backend",      g_backend,          "--memory-limit",
                                         "256MiB",         "--max-pages-per-request", "16"};
        for (const auto &a : extra_args)
            argv.push_back(a == "@STATE@" ? dir + "/state" : a);
        // Every daemon of a run may get more flags (ctest: --grpc-page-ops).
        std::istringstream more(env_or("KVC_TEST_DAEMON_ARGS", ""));
        for (std::string a; more >> a;)
            argv.push_back(a);
        ASSERT_TRUE(proc.start(argv, extra_env, false, log)) << "cannot start " << g_serve;
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (std::chrono::steady_clock::now() < until) {
            int st;
            if (waitpid(proc.pid, &st, WNOHANG) == proc.pid) {
                proc.pid = -1;
                FAIL() << "daemon exited during start-up:\n" << tail();
            }
            kvc_client *c = nullptr;
            if (kvc_client_create(sock.c_str(), &c) == KVC_OK) {
                kvc_client_destroy(c);
                return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        FAIL() << "daemon did not answer GetInfo within 60 s:\n" << tail();
    }

    // The same daemon again: same socket, same state directory.
    void restart() { start(args_, env_); }

    std::string tail() const
    {
        std::ifstream f(log);
        std::stringstream ss;
        ss << f.rdbuf();
        std::string s = ss.str();
        return s.size() > 4000 ? s.substr(s.size() - 4000) : s;
    }

    void stop()
    {
        if (proc.pid > 0) {
            kill(proc.pid, SIGTERM);
            for (int i = 0; i < 100; i++) {
                int st;
                if (waitpid(proc.pid, &st, WNOHANG) == proc.pid) {
                    proc.pid = -1;
                    return;
                }
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
            }
            proc.kill_and_wait(SIGKILL);
        }
    }

    ~Daemon() { stop(); }
};

#define KVC_OK_OR_FAIL(expr)                                                             \
    do {                                                                                 \
        kvc_status st_ = (expr);                                                         \
        ASSERT_EQ(st_, KVC_OK) << #expr << ": " << kvc_status_to_string(st_) << ": "     \
                               << kvc_last_error();                                      \
    } while (0)

#define EXPECT_STATUS(want, expr)                                                        \
    do {                                                                                 \
        kvc_status st_ = (expr);                                                         \
        EXPECT_EQ(st_, want) << #expr << " gave " << kvc_status_to_string(st_) << ": "   \
                             << kvc_last_error();                                        \
    } while (0)

// One shared daemon for the suite; tests that need their own start one.
class Kvc : public ::testing::Test {
protected:
    static Daemon *daemon_;

    static void SetUpTestSuite()
    {
        daemon_ = new Daemon();
        daemon_->start();
    }
    static void TearDownTestSuite()
    {
        delete daemon_;
        daemon_ = nullptr;
    }

    kvc_client *client = nullptr;
    std::vector<kvc_session *> sessions;

    void SetUp() override
    {
        ASSERT_NE(daemon_->proc.pid, -1) << "no daemon";
        KVC_OK_OR_FAIL(kvc_client_create(daemon_->sock.c_str(), &client));
    }
    std::vector<kvc_region *> regions;  // destroyed before the sessions

    kvc_region *mkregion(kvc_session *s, uint64_t size)
    {
        kvc_region *r = nullptr;
        kvc_status st = kvc_region_create(s, size, &r);
        EXPECT_EQ(st, KVC_OK) << kvc_last_error();
        if (r)
            regions.push_back(r);
        return r;
    }

    void destroy(kvc_region *r)
    {
        regions.erase(std::remove(regions.begin(), regions.end(), r), regions.end());
        kvc_region_destroy(r);
    }

    void TearDown() override
    {
        for (auto *r : regions)
            kvc_region_destroy(r);
        for (auto *s : sessions)
            kvc_session_close(s);
        kvc_client_destroy(client);
    }

    kvc_session *open(const char *name, uint64_t max_bytes = 0, int wait = 0,
                      uint32_t wait_ms = 0, kvc_status *status = nullptr)
    {
        kvc_session_options o;
        kvc_session_options_init(&o);
        o.name = name;
        o.max_bytes = max_bytes;
        o.wait = wait;
        o.wait_timeout_ms = wait_ms;
        kvc_session *s = nullptr;
        kvc_status st = kvc_session_open(client, &o, &s);
        if (status)
            *status = st;
        else
            EXPECT_EQ(st, KVC_OK) << kvc_last_error();
        if (s)
            sessions.push_back(s);
        return s;
    }

    void close(kvc_session *s)
    {
        EXPECT_STATUS(KVC_OK, kvc_session_close(s));
        sessions.erase(std::remove(sessions.begin(), sessions.end(), s), sessions.end());
    }

    static kvc_stats stats(kvc_session *s)
    {
        kvc_stats st;
        std::memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        kvc_status k = kvc_session_get_stats(s, &st);
        EXPECT_EQ(k, KVC_OK) << kvc_last_error();
        return st;
    }

    static void check_books(const kvc_stats &st)
    {
        EXPECT_EQ(st.device.pooled_bytes + st.device.in_use_bytes + st.device.free_bytes,
                  st.device.budget_bytes);
    }
};
Daemon *Kvc::daemon_ = nullptr;

// ---- connecting ------------------------------------------------------------

TEST_F(Kvc, ConnectReportsDevices)
{
    EXPECT_STREQ(kvc_client_backend(client), g_backend.c_str());
    EXPECT_STRNE(kvc_client_daemon_version(client), "");
    ASSERT_GE(kvc_client_device_count(client), 1u);
    kvc_device_info d;
    KVC_OK_OR_FAIL(kvc_client_device(client, 0, &d));
    EXPECT_STREQ(d.kind, g_backend.c_str());
    EXPECT_GT(d.page_size, 0u);
    EXPECT_EQ(d.page_size % d.granularity, 0u);
    EXPECT_EQ(d.budget_bytes, 256 * MiB);
    if (g_backend == "cuda")
        EXPECT_EQ(std::string(d.uuid).rfind("GPU-", 0), 0u) << d.uuid;
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_client_device(client, 99, &d));
}

TEST_F(Kvc, UnreachableDaemonIsUnavailable)
{
    kvc_client *c = nullptr;
    std::string nowhere = g_tmp + "/no-daemon.sock";
    EXPECT_STATUS(KVC_ERR_UNAVAILABLE, kvc_client_create(nowhere.c_str(), &c));
    EXPECT_EQ(c, nullptr);
    EXPECT_NE(std::string(kvc_last_error()).find("no-daemon.sock"), std::string::npos)
        << kvc_last_error();
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_client_create("", &c));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_client_create(nowhere.c_str(), nullptr));
}

TEST_F(Kvc, SocketFromEnvironment)
{
    // OLLAMA_KVCACHED_SOCKET wins over KVCACHED_SOCKET (setenv before any
    // other thread of this test reads the environment).
    setenv("KVCACHED_SOCKET", (g_tmp + "/wrong.sock").c_str(), 1);
    setenv("OLLAMA_KVCACHED_SOCKET", daemon_->sock.c_str(), 1);
    EXPECT_EQ(std::string(kvc_socket_from_env()), daemon_->sock);
    kvc_client *c = nullptr;
    EXPECT_STATUS(KVC_OK, kvc_client_create(nullptr, &c));
    kvc_client_destroy(c);
    unsetenv("OLLAMA_KVCACHED_SOCKET");
    EXPECT_EQ(std::string(kvc_socket_from_env()), g_tmp + "/wrong.sock");
    EXPECT_STATUS(KVC_ERR_UNAVAILABLE, kvc_client_create(nullptr, &c));
    setenv("KVCACHED_SOCKET", daemon_->sock.c_str(), 1);
    EXPECT_STATUS(KVC_OK, kvc_client_create(nullptr, &c));
    kvc_client_destroy(c);
    unsetenv("KVCACHED_SOCKET");
    EXPECT_EQ(kvc_socket_from_env(), nullptr);
}

// ---- sessions ----------------------------------------------------------------

TEST_F(Kvc, SessionOpenValidates)
{
    kvc_session_options o;
    kvc_session_options_init(&o);
    kvc_session *s = nullptr;
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_open(client, &o, &s));  // no name
    o.name = "";  // the daemon refuses an empty name
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_open(client, &o, &s));
    EXPECT_NE(std::string(kvc_last_error()).find("OpenSession"), std::string::npos);
    o.name = "bad limits";
    o.guaranteed_bytes = 8 * MiB;
    o.max_bytes = 4 * MiB;  // guarantee above maximum
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_open(client, &o, &s));
    o.guaranteed_bytes = o.max_bytes = 0;
    o.device = "GPU-00000000-0000-0000-0000-000000000000";
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_open(client, &o, &s));
    o.device = nullptr;
    o.struct_size = 3;
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_open(client, &o, &s));
    EXPECT_EQ(s, nullptr);
}

TEST_F(Kvc, SessionFactsAndStats)
{
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "facts";
    o.priority = 3;
    o.max_bytes = 64 * MiB;
    kvc_label labels[] = {{"model_digest", "sha256:abc"}, {"runner", "c-test"}};
    o.labels = labels;
    o.num_labels = 2;
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(client, &o, &s));
    sessions.push_back(s);
    EXPECT_GT(kvc_session_id(s), 0u);
    EXPECT_STREQ(kvc_session_kind(s), g_backend.c_str());
    EXPECT_EQ(kvc_session_ended(s), 0);
    EXPECT_EQ(kvc_session_is_admin(s), 1);  // the daemon's own uid is admin
    kvc_stats st = stats(s);
    EXPECT_EQ(st.priority, 3);
    EXPECT_EQ(st.max_bytes, 64 * MiB);
    EXPECT_EQ(st.pid, static_cast<uint32_t>(getpid()));
    EXPECT_EQ(st.held_bytes, 0u);
    EXPECT_GE(st.sessions_open, 1u);
    check_books(st);
}

// ---- malloc-style blocks -------------------------------------------------------

TEST_F(Kvc, AllocFreeAvailableLimit)
{
    kvc_session *s = open("alloc");
    uint64_t page = kvc_session_page_size(s);
    uint64_t before = 0;
    KVC_OK_OR_FAIL(kvc_session_available(s, &before));
    EXPECT_GT(before, 0u);
    EXPECT_LE(before, 256 * MiB);

    void *p = nullptr;
    KVC_OK_OR_FAIL(kvc_session_alloc(s, page + 1, &p));  // rounds up to 2 pages
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % page, 0u);
    EXPECT_EQ(kvc_session_held_bytes(s), 2 * page);
    EXPECT_EQ(stats(s).held_bytes, 2 * page);
    if (g_backend == "host") {  // host pointers are plain memory
        auto *b = static_cast<unsigned char *>(p);
        for (uint64_t i = 0; i < 2 * page; i += 4096)
            ASSERT_EQ(b[i], 0) << "fresh page not zero at " << i;
        std::memset(b, 0x5a, 2 * page);
    }
    uint64_t after = 0;
    KVC_OK_OR_FAIL(kvc_session_available(s, &after));
    EXPECT_EQ(after, before - 2 * page);

    // The client-side limit (the seed's kvcached_set_limit).
    KVC_OK_OR_FAIL(kvc_session_set_limit(s, 3 * page));
    EXPECT_EQ(kvc_session_limit(s), 3 * page);
    KVC_OK_OR_FAIL(kvc_session_available(s, &after));
    EXPECT_EQ(after, page);
    void *q = nullptr;
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_session_alloc(s, 2 * page, &q));
    EXPECT_NE(std::string(kvc_last_error()).find("limit"), std::string::npos);
    EXPECT_EQ(q, nullptr);
    KVC_OK_OR_FAIL(kvc_session_alloc(s, page, &q));
    KVC_OK_OR_FAIL(kvc_session_set_limit(s, 0));

    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_free(s, reinterpret_cast<char *>(p) + 1));
    EXPECT_STATUS(KVC_OK, kvc_session_free(s, nullptr));
    KVC_OK_OR_FAIL(kvc_session_free(s, p));
    KVC_OK_OR_FAIL(kvc_session_free(s, q));
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_free(s, p));  // twice
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    kvc_stats st = stats(s);
    EXPECT_EQ(st.held_bytes, 0u);
    check_books(st);
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_alloc(s, 0, &p));
}

// Pages as descriptors (API 1.4): borrowed unmapped with their fds, given
// back by id, all or nothing, with the daemon's own checks.
TEST_F(Kvc, PagesAsDescriptors)
{
    kvc_session *s = open("fds");
    const uint64_t P = kvc_session_page_size(s);
    uint64_t ids[3] = {0, 0, 0};
    int fds[3] = {-1, -1, -1};
    KVC_OK_OR_FAIL(kvc_session_alloc_pages(s, 3, ids, fds));
    EXPECT_NE(ids[0], ids[1]);
    EXPECT_NE(ids[1], ids[2]);
    EXPECT_NE(ids[0], ids[2]);
    for (int fd : fds)
        EXPECT_GE(fcntl(fd, F_GETFD), 0) << "not an open descriptor";
    if (g_backend == "host") {  // a memfd of one page, fresh: zeros
        for (int fd : fds) {
            struct stat sb;
            ASSERT_EQ(fstat(fd, &sb), 0);
            EXPECT_EQ(static_cast<uint64_t>(sb.st_size), P);
            unsigned char b = 0xff;
            EXPECT_EQ(pread(fd, &b, 1, static_cast<off_t>(P / 2)), 1);
            EXPECT_EQ(b, 0);
        }
    }
    for (int fd : fds)
        ::close(fd);  // the pages stay the session's
    EXPECT_EQ(kvc_session_held_bytes(s), 3 * P);
    EXPECT_EQ(stats(s).held_bytes, 3 * P);
    uint64_t freed = 99;
    // All or nothing: one id the session does not hold refuses the whole Free.
    uint64_t bad[2] = {ids[0], 987654321};
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_free_pages(s, bad, 2, &freed));
    EXPECT_EQ(freed, 0u);
    uint64_t twice[2] = {ids[0], ids[0]};
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_free_pages(s, twice, 2, &freed));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_free_pages(s, ids, 0, &freed));
    EXPECT_EQ(stats(s).held_bytes, 3 * P);
    KVC_OK_OR_FAIL(kvc_session_free_pages(s, ids, 3, &freed));
    EXPECT_EQ(freed, 3u);
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    kvc_stats st = stats(s);
    EXPECT_EQ(st.held_bytes, 0u);
    check_books(st);
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_free_pages(s, ids, 1, nullptr));  // freed already
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_alloc_pages(s, 0, ids, fds));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_alloc_pages(s, 1, nullptr, fds));
}

TEST_F(Kvc, DaemonLimitsAreResourceExhausted)
{
    kvc_session *s = open("max", 4 * 2 * MiB);
    uint64_t page = kvc_session_page_size(s);
    void *p = nullptr;
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_session_alloc(s, 5 * page, &p));
    KVC_OK_OR_FAIL(kvc_session_alloc(s, 4 * page, &p));
    KVC_OK_OR_FAIL(kvc_session_free(s, p));
    // Beyond the whole budget.
    kvc_session *t = open("budget");
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_session_alloc(t, 300 * MiB, &p));
    EXPECT_EQ(kvc_session_held_bytes(t), 0u);
    check_books(stats(t));
}

// ---- regions ------------------------------------------------------------------------

TEST_F(Kvc, RegionMapUnmapRanges)
{
    kvc_session *s = open("region");
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 40 * P - 5, &r));
    EXPECT_EQ(kvc_region_size(r), 40 * P);
    EXPECT_EQ(kvc_region_page_size(r), P);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(kvc_region_base(r)) % P, 0u);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 0u);

    uint64_t allocs0 = stats(s).allocations_total;
    // Prefixes of three "tensors" at page-aligned offsets, overlapping pages
    // counted once: [0, P+1) -> pages 0,1; [10P, 10P+1) -> 10; [P, 2P) -> 1.
    kvc_range rs[] = {{0, P + 1}, {10 * P, 1}, {P, P}};
    KVC_OK_OR_FAIL(kvc_region_map_ranges(r, rs, 3));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 3 * P);
    EXPECT_EQ(stats(s).allocations_total, allocs0 + 1) << "one Allocate for all ranges";
    EXPECT_EQ(stats(s).pages_held, 3u);
    EXPECT_TRUE(kvc_region_is_mapped(r, 0, 2 * P));
    EXPECT_FALSE(kvc_region_is_mapped(r, 0, 2 * P + 1));
    EXPECT_TRUE(kvc_region_is_mapped(r, 10 * P, P));

    // Mapping what is mapped is free.
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * P));
    EXPECT_EQ(stats(s).allocations_total, allocs0 + 1);

    // Data across a page boundary; fresh pages are zero.
    std::vector<uint8_t> data(P + 100), back(P + 100);
    for (size_t i = 0; i < data.size(); i++)
        data[i] = static_cast<uint8_t>(i * 7 + 1);
    KVC_OK_OR_FAIL(kvc_region_read(r, 10 * P, back.data(), P));
    for (uint64_t i = 0; i < P; i++)
        ASSERT_EQ(back[i], 0) << "fresh page not zero at " << i;
    KVC_OK_OR_FAIL(kvc_region_write(r, P / 2, data.data(), data.size()));
    KVC_OK_OR_FAIL(kvc_region_read(r, P / 2, back.data(), back.size()));
    EXPECT_EQ(data, back);
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_region_read(r, 2 * P - 10, back.data(), 20));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_map(r, 39 * P, 2 * P));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_unmap(r, 41 * P, 1));

    // Unmap narrows inward: [P/2, 2P) only contains page 1 wholly.
    KVC_OK_OR_FAIL(kvc_region_unmap(r, P / 2, P + P / 2));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    EXPECT_TRUE(kvc_region_is_mapped(r, 0, P));
    EXPECT_FALSE(kvc_region_is_mapped(r, P, 1));
    EXPECT_EQ(stats(s).pages_held, 2u);
    // Page 0 kept its data.
    KVC_OK_OR_FAIL(kvc_region_read(r, P / 2, back.data(), P / 2));
    EXPECT_EQ(0, std::memcmp(back.data(), data.data(), P / 2));

    // Grow the prefix again past the hole.
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 5 * P));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 6 * P);
    kvc_range trim[] = {{2 * P, 3 * P}, {10 * P, P}};
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges(r, trim, 2));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    EXPECT_EQ(kvc_session_held_bytes(s), 2 * P);

    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_close(s));  // region alive
    kvc_region_destroy(r);
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    kvc_stats st = stats(s);
    EXPECT_EQ(st.pages_held, 0u);
    check_books(st);
}

// A range that runs to the region's end (max_bytes as created, not a whole
// number of pages) releases the last, partly padded page: every page can be
// given back. A range ending inside the region is still narrowed inward.
TEST_F(Kvc, RangeToTheRegionEndReleasesItsLastPage)
{
    kvc_session *s = open("region-end");
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = mkregion(s, 2 * P + P / 2);  // reserves 3 pages
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(kvc_region_size(r), 3 * P);
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * P + P / 2));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 3 * P);
    // [2P, 2.5P): the tail of the last page only, running to the end
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 2 * P, P / 2));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    EXPECT_EQ(stats(s).pages_held, 2u);
    // a range ending inside: [P/2, 1.5P) holds no whole page, nothing goes
    KVC_OK_OR_FAIL(kvc_region_unmap(r, P / 2, P));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    // a zero-size range at the end unmaps nothing
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * P + P / 2));
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 2 * P + P / 2, 0));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 3 * P);
    // [P/2, 2.5P) in a list of ranges: pages 1 and 2
    kvc_range rs[] = {{0, 1}, {P / 2, 2 * P}};
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges(r, rs, 2));
    EXPECT_EQ(kvc_region_mapped_bytes(r), P);
    EXPECT_TRUE(kvc_region_is_mapped(r, 0, P));
    // [0, end): everything
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 2 * P + P / 2));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 0u);
    kvc_stats st = stats(s);
    EXPECT_EQ(st.pages_held, 0u);
    check_books(st);
}

TEST_F(Kvc, ClearTouchesOnlyMappedPages)
{
    kvc_session *s = open("clear");
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * P, &r));
    kvc_range rs[] = {{0, P}, {4 * P, 2 * P}};
    KVC_OK_OR_FAIL(kvc_region_map_ranges(r, rs, 2));
    KVC_OK_OR_FAIL(kvc_region_clear(r, 0xab));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 3 * P) << "clear mapped nothing new";
    std::vector<uint8_t> b(P);
    KVC_OK_OR_FAIL(kvc_region_read(r, 5 * P, b.data(), P));
    EXPECT_EQ(b[0], 0xab);
    EXPECT_EQ(b[P - 1], 0xab);
    // Partial memset inside mapped pages and across a hole.
    KVC_OK_OR_FAIL(kvc_region_memset(r, P - 8, 3 * P + 16, 0x11));
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, b.data(), P));
    EXPECT_EQ(b[P - 9], 0xab);
    EXPECT_EQ(b[P - 8], 0x11);
    KVC_OK_OR_FAIL(kvc_region_read(r, 4 * P, b.data(), P));
    EXPECT_EQ(b[7], 0x11);
    EXPECT_EQ(b[8], 0xab);
    // A hole mapped afterwards reads zero.
    KVC_OK_OR_FAIL(kvc_region_map(r, 2 * P, P));
    KVC_OK_OR_FAIL(kvc_region_read(r, 2 * P, b.data(), P));
    EXPECT_EQ(b[0], 0);
    EXPECT_EQ(b[P - 1], 0);
    kvc_region_destroy(r);
}

TEST_F(Kvc, LargeMapIsSplitAtMaxPagesPerRequest)
{
    kvc_session *s = open("split");
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 64 * P, &r));
    uint64_t a0 = stats(s).allocations_total;
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 40 * P));  // the daemon allows 16 per call
    EXPECT_EQ(stats(s).allocations_total, a0 + 3);
    EXPECT_EQ(stats(s).pages_held, 40u);
    kvc_region_destroy(r);
    EXPECT_EQ(stats(s).pages_held, 0u);
}

TEST_F(Kvc, HugeRegionIsNoMemory)
{
    kvc_session *s = open("huge");
    kvc_region *r = nullptr;
    EXPECT_STATUS(KVC_ERR_NO_MEMORY, kvc_region_create(s, 1ull << 50, &r));  // 1 PiB
    EXPECT_EQ(r, nullptr);
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_create(s, 0, &r));
}

TEST_F(Kvc, ConcurrentRegionsOnOneSession)
{
    kvc_session *s = open("threads");
    const uint64_t P = kvc_session_page_size(s);
    std::atomic<int> bad{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; t++)
        ts.emplace_back([&, t] {
            kvc_region *r = nullptr;
            if (kvc_region_create(s, 8 * P, &r) != KVC_OK) {
                bad++;
                return;
            }
            for (int i = 0; i < 10; i++) {
                uint8_t v = static_cast<uint8_t>(t * 16 + i), w = 0;
                if (kvc_region_map(r, 0, (1 + i % 4) * P) != KVC_OK ||
                    kvc_region_write(r, P - 1, &v, 1) != KVC_OK ||
                    kvc_region_read(r, P - 1, &w, 1) != KVC_OK || v != w ||
                    kvc_region_unmap(r, P, 8 * P - P) != KVC_OK)
                    bad++;
            }
            kvc_region_destroy(r);
        });
    for (auto &t : ts)
        t.join();
    EXPECT_EQ(bad.load(), 0);
    EXPECT_EQ(stats(s).pages_held, 0u);
}

// ---- reclaim -----------------------------------------------------------------------------

struct ReclaimLog {
    std::mutex mu;
    std::vector<kvc_reclaim> seen;
    std::vector<std::string> devices, reasons;
    kvc_region *region = nullptr;  // unmap from its end when asked
    bool comply = true;
    std::atomic<int> calls{0};
};

void on_reclaim(void *user, const kvc_reclaim *rq)
{
    auto *log = static_cast<ReclaimLog *>(user);
    {
        std::lock_guard<std::mutex> g(log->mu);
        log->seen.push_back(*rq);
        log->devices.push_back(rq->device);
        log->reasons.push_back(rq->reason);
    }
    if (log->comply && log->region) {
        uint64_t size = kvc_region_size(log->region);
        uint64_t give = rq->bytes > size ? size : rq->bytes;
        kvc_region_unmap(log->region, size - give, give);
    }
    log->calls++;
}

TEST_F(Kvc, ReclaimCallbackOnAdminShrink)
{
    kvc_session *a = open("shrink-me");
    const uint64_t P = kvc_session_page_size(a);
    ReclaimLog log;
    kvc_region *ra = mkregion(a, 20 * P);
    ASSERT_NE(ra, nullptr);
    KVC_OK_OR_FAIL(kvc_region_map(ra, 0, 20 * P));
    log.region = ra;
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, on_reclaim, &log));
    kvc_session *b = open("admin-b");
    double t0 = static_cast<double>(time(nullptr));
    uint64_t asked = 0;
    KVC_OK_OR_FAIL(kvc_session_request_shrink(b, kvc_session_id(a), 4 * P, 5000, &asked));
    EXPECT_EQ(asked, 16u);
    for (int i = 0; i < 100 && log.calls.load() < 1; i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    {
        std::lock_guard<std::mutex> g(log.mu);
        ASSERT_EQ(log.seen.size(), 1u);
        EXPECT_EQ(log.seen[0].pages, 16u);
        EXPECT_EQ(log.seen[0].bytes, 16 * P);
        EXPECT_GE(log.seen[0].deadline_unix, t0);
        EXPECT_EQ(log.devices[0], kvc_session_device(a));
        EXPECT_EQ(log.reasons[0], "admin");
    }
    EXPECT_EQ(kvc_region_mapped_bytes(ra), 4 * P);
    EXPECT_EQ(stats(a).pages_held, 4u);
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_request_shrink(b, 999999, 0, 0, nullptr));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, nullptr, nullptr));
    destroy(ra);
}

// ---- the reclaim answer (API 1.3) ------------------------------------------

// A session that gives back part of what is asked and answers at once.
struct Answerer {
    kvc_session *s = nullptr;
    kvc_region *region = nullptr;
    uint64_t give_pages = 0;  // unmapped from the region's end before answering
    std::mutex mu;
    std::vector<uint64_t> ids;
    std::vector<kvc_status> answers;
    std::atomic<int> calls{0};
};

void answer_in_callback(void *user, const kvc_reclaim *rq)
{
    auto *a = static_cast<Answerer *>(user);
    const uint64_t P = kvc_region_page_size(a->region);
    const uint64_t size = kvc_region_size(a->region);
    kvc_status un = kvc_region_unmap(a->region, size - a->give_pages * P, a->give_pages * P);
    kvc_status st = un != KVC_OK ? un
                                 : kvc_session_answer_reclaim(a->s, rq->id, a->give_pages * P,
                                                              kvc_region_mapped_bytes(a->region),
                                                              "the rest is in use by busy slots");
    {
        std::lock_guard<std::mutex> g(a->mu);
        a->ids.push_back(rq->id);
        a->answers.push_back(st);
    }
    a->calls++;
}

// The daemon's RequestShrink(wait) (called from Python: this test does not
// link gRPC) prints every outcome as one line:
// "outcome <reclaim_id> <STATE> <answered> <given> <kept> <held> <seconds>|<reason>".
std::string shrink_wait_outcomes(const std::string &sock, uint64_t target, uint64_t bytes,
                                 uint32_t timeout_ms)
{
    const char *script =
        "import sys, time\n"
        "from kvcached_service.client import Client\n"
        "with Client.connect(sys.argv[1]) as c:\n"
        "    s = c.open_session('shrinker')\n"
        "    t0 = time.monotonic()\n"
        "    r = s.shrink(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), wait=True)\n"
        "    dt = time.monotonic() - t0\n"
        "    print('asked', r.pages_requested)\n"
        "    for o in r.reclaims:\n"
        "        print('outcome', o.reclaim_id, o.state, int(o.answered), o.bytes_given, "
        "o.bytes_kept, o.held_bytes, '%.3f|%s' % (dt, o.reason))\n"
        "    s.close()\n";
    int code = 0;
    std::string out = run({g_python, "-c", script, sock, std::to_string(target),
                           std::to_string(bytes), std::to_string(timeout_ms)},
                          {"PYTHONPATH=" + g_repo}, &code);
    EXPECT_EQ(code, 0) << out;
    return out;
}

TEST_F(Kvc, ReclaimAnswerReachesRequestShrinkWait)
{
    EXPECT_GE(kvc_api_version(), 10300);
    kvc_session *a = open("answers");
    const uint64_t P = kvc_session_page_size(a);
    Answerer ans;
    ans.s = a;
    ans.region = mkregion(a, 20 * P);
    ASSERT_NE(ans.region, nullptr);
    KVC_OK_OR_FAIL(kvc_region_map(ans.region, 0, 20 * P));
    ans.give_pages = 2;  // asked for 16, gives 2, keeps 18
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, answer_in_callback, &ans));

    // A 60 s deadline: an answer that did not arrive would leave the request
    // OPEN or EXPIRED far later; the answered one returns at once (the
    // bound below is generous for a loaded CI machine).
    std::string out = shrink_wait_outcomes(daemon_->sock, kvc_session_id(a), 4 * P, 60000);
    for (int i = 0; i < 200 && ans.calls.load() < 1; i++)  // the callback returns after its answer
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_EQ(ans.calls.load(), 1) << out;
    uint64_t id;
    {
        std::lock_guard<std::mutex> g(ans.mu);
        id = ans.ids[0];
        EXPECT_EQ(ans.answers[0], KVC_OK) << kvc_last_error();
    }
    EXPECT_NE(id, 0u);
    std::istringstream lines(out);
    std::string line;
    int outcomes = 0;
    while (std::getline(lines, line)) {
        if (line.rfind("asked ", 0) == 0)
            EXPECT_EQ(line, "asked 16");
        if (line.rfind("outcome ", 0) != 0)
            continue;
        outcomes++;
        std::istringstream f(line.substr(8));
        uint64_t rid = 0, given = 0, kept = 0, held = 0;
        int answered = 0;
        std::string state, rest;
        f >> rid >> state >> answered >> given >> kept >> held >> rest;
        std::string seconds = rest.substr(0, rest.find('|'));
        std::string reason = line.substr(line.find('|') + 1);
        EXPECT_EQ(rid, id) << line;
        EXPECT_EQ(state, "ANSWERED") << line;
        EXPECT_EQ(answered, 1) << line;
        EXPECT_EQ(given, 2 * P) << line;
        EXPECT_EQ(kept, 18 * P) << line;
        EXPECT_EQ(held, 18 * P) << line;  // the daemon's books agree with the answer
        EXPECT_EQ(reason, "the rest is in use by busy slots") << line;
        EXPECT_LT(std::stod(seconds), 30.0) << "the wait did not end at the answer: " << line;
    }
    EXPECT_EQ(outcomes, 1) << out;
    EXPECT_EQ(stats(a).pages_held, 18u);
    EXPECT_EQ(stats(a).reclaim_ignored, 0u);

    // Answering again (an id this session was sent) is accepted; an id it
    // was never sent is NOT_FOUND; a reason over 1024 bytes is refused here.
    KVC_OK_OR_FAIL(kvc_session_answer_reclaim(a, id, 0, 18 * P, nullptr));
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_answer_reclaim(a, id + 1000000, 0, 0, ""));
    EXPECT_NE(std::string(kvc_last_error()).find("reclaim"), std::string::npos) << kvc_last_error();
    std::string long_reason(1025, 'x');
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT,
                  kvc_session_answer_reclaim(a, id, 0, 0, long_reason.c_str()));
    EXPECT_NE(std::string(kvc_last_error()).find("1025"), std::string::npos) << kvc_last_error();
    long_reason.resize(1024);
    KVC_OK_OR_FAIL(kvc_session_answer_reclaim(a, id, 0, 18 * P, long_reason.c_str()));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_answer_reclaim(nullptr, id, 0, 0, ""));
    // The session goes on after every refusal.
    KVC_OK_OR_FAIL(kvc_region_map(ans.region, 0, 20 * P));
    EXPECT_EQ(stats(a).pages_held, 20u);
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, nullptr, nullptr));
    destroy(ans.region);
}

// Needs the daemon's waiting Allocate (issue 4: wait=true asks other
// sessions to give pages back through Watch).
TEST_F(Kvc, WaitingAllocateReclaimsFromAnIdleSession)
{
    kvc_session *a = open("idle-a");
    const uint64_t P = kvc_session_page_size(a);
    ReclaimLog log;
    kvc_region *ra = mkregion(a, 120 * P);
    ASSERT_NE(ra, nullptr);
    KVC_OK_OR_FAIL(kvc_region_map(ra, 0, 120 * P));
    log.region = ra;
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, on_reclaim, &log));

    kvc_session *b = open("busy-b", 0, 1, 3000);
    kvc_region *rb = mkregion(b, 16 * P);
    ASSERT_NE(rb, nullptr);
    // One Allocate of 16 pages; at most 8 are left, the rest must come from a.
    KVC_OK_OR_FAIL(kvc_region_map(rb, 0, 16 * P));
    // The Allocate may return as soon as the callback's Free landed, before
    // the callback itself returns and counts.
    for (int i = 0; i < 100 && log.calls.load() < 1; i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_GE(log.calls.load(), 1);
    {
        std::lock_guard<std::mutex> g(log.mu);
        ASSERT_FALSE(log.seen.empty());
        EXPECT_EQ(log.reasons[0], "allocate");
    }
    check_books(stats(b));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, nullptr, nullptr));
}

// Also needs issue 4's waiting Allocate.
TEST_F(Kvc, WaitingAllocateIgnoredFailsAtTheDeadlineNamingTheHolder)
{
    kvc_session *a = open("stubborn-holder");
    const uint64_t P = kvc_session_page_size(a);
    ReclaimLog log;
    log.comply = false;
    kvc_region *ra = mkregion(a, 120 * P);
    ASSERT_NE(ra, nullptr);
    KVC_OK_OR_FAIL(kvc_region_map(ra, 0, 120 * P));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, on_reclaim, &log));
    kvc_session *b = open("waiter", 0, 1, 400);
    void *p = nullptr;
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_session_alloc(b, 20 * P, &p));
    EXPECT_NE(std::string(kvc_last_error()).find("stubborn-holder"), std::string::npos)
        << kvc_last_error();
    EXPECT_GE(log.calls.load(), 1) << "the holder was never asked";
    destroy(ra);
}

// kvc_session_set_wait: the same session fails at once without waiting (and
// without asking anyone), then waits again when told to.
TEST_F(Kvc, SetWaitSwitchesWaitingOffAndOn)
{
    kvc_session *a = open("holds-most");
    const uint64_t P = kvc_session_page_size(a);
    ReclaimLog log;
    log.comply = false;
    kvc_region *ra = mkregion(a, 120 * P);
    ASSERT_NE(ra, nullptr);
    KVC_OK_OR_FAIL(kvc_region_map(ra, 0, 120 * P));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, on_reclaim, &log));
    kvc_session *b = open("switches", 0, 1, 3000);
    kvc_region *rb = mkregion(b, 20 * P);
    ASSERT_NE(rb, nullptr);
    KVC_OK_OR_FAIL(kvc_session_set_wait(b, 0, 0));
    auto t = std::chrono::steady_clock::now();
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_region_map(rb, 0, 20 * P));
    auto ms = [&] {
        return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t).count();
    };
    EXPECT_LT(ms(), 1500) << "an Allocate without wait must not wait 3000 ms";
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_EQ(log.calls.load(), 0) << "without wait nobody is asked";
    KVC_OK_OR_FAIL(kvc_session_set_wait(b, 1, 400));
    t = std::chrono::steady_clock::now();
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_region_map(rb, 0, 20 * P));
    EXPECT_GE(ms(), 350) << "with wait the daemon waits for the holder";
    EXPECT_GE(log.calls.load(), 1) << "with wait the holder is asked";
    EXPECT_EQ(kvc_region_mapped_bytes(rb), 0u);
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_set_wait(nullptr, 1, 0));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, nullptr, nullptr));
    destroy(ra);
}

TEST_F(Kvc, WaitAvailableTimesOut)
{
    kvc_session *b = open("waits");
    EXPECT_STATUS(KVC_ERR_DEADLINE_EXCEEDED, kvc_session_wait_available(b, 200));
    EXPECT_NE(std::string(kvc_last_error()).find("MEMORY_AVAILABLE"), std::string::npos);
}

TEST_F(Kvc, CloseFromTheReclaimCallbackIsRefused)
{
    kvc_session *a = open("self-close");
    const uint64_t P = kvc_session_page_size(a);
    struct Ctx {
        kvc_session *s;
        std::atomic<int> status{-1};
    } ctx{a};
    auto cb = [](void *u, const kvc_reclaim *) {
        auto *c = static_cast<Ctx *>(u);
        c->status = kvc_session_close(c->s);
    };
    void *p = nullptr;
    KVC_OK_OR_FAIL(kvc_session_alloc(a, 4 * P, &p));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(a, cb, &ctx));
    kvc_session *b = open("admin");
    KVC_OK_OR_FAIL(kvc_session_request_shrink(b, kvc_session_id(a), 0, 2000, nullptr));
    for (int i = 0; i < 50 && ctx.status.load() < 0; i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(ctx.status.load(), KVC_ERR_FAILED_PRECONDITION);
    KVC_OK_OR_FAIL(kvc_session_free(a, p));
}

// ---- processes ---------------------------------------------------------------------------

TEST_F(Kvc, KilledClientGivesEverythingBackWithinASecond)
{
    kvc_session *s = open("observer");
    uint64_t in_use0 = stats(s).device.in_use_bytes;
    Proc p;
    ASSERT_TRUE(p.start({g_helper, "hold", daemon_->sock, "10"}, {}, true));
    ASSERT_EQ(p.read_line(), "READY");
    const uint64_t P = kvc_session_page_size(s);
    EXPECT_EQ(stats(s).device.in_use_bytes, in_use0 + 10 * P);
    p.kill_and_wait(SIGKILL);
    auto t0 = std::chrono::steady_clock::now();
    uint64_t now = 0;
    while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(1000)) {
        now = stats(s).device.in_use_bytes;
        if (now == in_use0)
            break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(now, in_use0);
    check_books(stats(s));
}

TEST_F(Kvc, PythonReadsWhatCWrote)
{
    Proc py;
    ASSERT_TRUE(py.start({g_python, g_repo + "/clients/c/tests/python_readback.py", daemon_->sock},
                         {"PYTHONPATH=" + g_repo}, true));
    std::string ready = py.read_line(60);
    ASSERT_EQ(ready.rfind("READY ", 0), 0u) << "python said: " << ready;
    kvc_session *s = open("c-writer");
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, P));
    std::vector<uint8_t> head(64), tail(64);
    for (int i = 0; i < 64; i++) {
        head[i] = static_cast<uint8_t>(0xC0 + i);
        tail[i] = static_cast<uint8_t>(255 - i);
    }
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, head.data(), 64));
    KVC_OK_OR_FAIL(kvc_region_write(r, P - 64, tail.data(), 64));
    py.write_line("go");
    std::string data = py.read_line(60);
    auto hex = [](const std::vector<uint8_t> &v) {
        std::string s;
        char b[3];
        for (uint8_t x : v) {
            std::snprintf(b, sizeof b, "%02x", x);
            s += b;
        }
        return s;
    };
    EXPECT_EQ(data, "DATA " + hex(head) + " " + hex(tail));
    EXPECT_EQ(py.wait(), 0);
    kvc_region_destroy(r);
}

// valgrind: a connect / allocate / free / disconnect cycle leaks nothing.
// Run by the valgrind_host ctest entry (KVC_VALGRIND set); gRPC's and
// protobuf's one-time process globals are suppressed by valgrind.supp.
void valgrind_cycle(const std::string &sock, bool resumable)
{
    std::string vg = env_or("KVC_VALGRIND", "");
    ASSERT_FALSE(vg.empty()) << "set KVC_VALGRIND to valgrind's path";
    std::string supp = g_repo + "/clients/c/tests/valgrind.supp";
    std::string log = g_tmp + "/valgrind.log";
    unlink(log.c_str());
    int code = 0;
    std::string out = run({vg, "--leak-check=full", "--show-leak-kinds=definite,indirect,possible",
                           "--errors-for-leak-kinds=definite,indirect,possible",
                           "--error-exitcode=99", "--suppressions=" + supp, "--log-file=" + log,
                           g_helper, "cycle", sock, "3"},
                          {}, &code);
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    EXPECT_EQ(code, 0) << out << "\n" << ss.str();
    EXPECT_NE(out.find("STATUS KVC_OK"), std::string::npos) << out;
    EXPECT_NE(out.find(std::string("RESUMABLE ") + (resumable ? "1" : "0") + " FDS_LEAKED 0"),
              std::string::npos)
        << out;
    EXPECT_NE(ss.str().find("definitely lost: 0 bytes"), std::string::npos) << ss.str();
}

TEST_F(Kvc, ValgrindCycleLeaksNothing) { valgrind_cycle(daemon_->sock, false); }

// The same with resumable sessions (kept page fds, the monitor thread).
TEST(KvcOwnDaemon, ValgrindResumableCycleLeaksNothing)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--state-dir", "@STATE@"}));
    valgrind_cycle(d.sock, true);
    d.stop();
}

// ---- statuses that need a daemon of their own ----------------------------------------

// The daemon's own uid is always allowed and always admin, so these run the
// helper as other uids (setpriv; the tests run as root, as on CI).
TEST(KvcOwnDaemon, OtherUidsArePermissionDenied)
{
    ASSERT_EQ(geteuid(), 0u) << "needs root to run clients as other uids";
    chmod(g_tmp.c_str(), 0755);
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--allowed-uids", "65534", "--socket-mode", "666"}));
    chmod(d.dir.c_str(), 0755);
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "root-admin";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    int code = 0;
    // uid 65533 is not in allowed_uids: refused on the fd channel.
    std::string out = run({"/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups",
                           g_helper, "open", d.sock},
                          {}, &code);
    EXPECT_EQ(out.rfind("STATUS KVC_ERR_PERMISSION_DENIED", 0), 0u) << out;
    EXPECT_NE(out.find("allowed_uids"), std::string::npos) << out;
    // uid 65534 may open a session but is no admin.
    out = run({"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", g_helper,
               "shrink", d.sock, std::to_string(kvc_session_id(s))},
              {}, &code);
    EXPECT_EQ(out.rfind("STATUS KVC_ERR_PERMISSION_DENIED", 0), 0u) << out;
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

TEST(KvcOwnDaemon, TooManySessionsIsResourceExhausted)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--max-sessions", "1"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "first";
    kvc_session *s1 = nullptr, *s2 = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s1));
    o.name = "second";
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_session_open(c, &o, &s2));
    EXPECT_STATUS(KVC_OK, kvc_session_close(s1));
    kvc_client_destroy(c);
}

// ---- requests on the fd channel ----------------------------------------------

// A raw gRPC Allocate, from Python (this test does not link gRPC): prints
// "info <requests> <only>" and "allocate <code name>".
std::string raw_grpc_allocate(const std::string &sock)
{
    const char *script =
        "import sys, grpc\n"
        "from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb, "
        "kvcached_pb2_grpc as pbg\n"
        "stub = pbg.KVCachedStub(grpc.insecure_channel('unix:' + sys.argv[1]))\n"
        "i = stub.GetInfo(pb.GetInfoRequest(), timeout=30)\n"
        "print('info', int(i.fd_channel_requests), int(i.fd_channel_requests_only))\n"
        "try:\n"
        "    stub.Allocate(pb.AllocateRequest(session=pb.SessionRef(id=1, token=b'x'), "
        "num_pages=1), timeout=30)\n"
        "    print('allocate OK')\n"
        "except grpc.RpcError as e:\n"
        "    print('allocate', e.code().name)\n";
    int code = 0;
    std::string out = run({g_python, "-c", script, sock}, {"PYTHONPATH=" + g_repo}, &code);
    EXPECT_EQ(code, 0) << out;
    return out;
}

// With --channel-ops-only the daemon refuses the gRPC Allocate/Free/Close,
// so everything the library does here went over the fd channel.
TEST(KvcOwnDaemon, ChannelOpsOnlyDaemonRefusesGrpcWhileTheLibraryWorks)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--channel-ops-only"}));
    EXPECT_EQ(raw_grpc_allocate(d.sock), "info 1 1\nallocate FAILED_PRECONDITION\n");
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "channel-only";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 40 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 40 * P));  // 3 ALLOCATEs (16 pages a request)
    std::vector<uint8_t> w(256), got(256);
    for (size_t i = 0; i < w.size(); i++)
        w[i] = static_cast<uint8_t>(i * 7);
    KVC_OK_OR_FAIL(kvc_region_write(r, 39 * P + 100, w.data(), w.size()));
    KVC_OK_OR_FAIL(kvc_region_read(r, 39 * P + 100, got.data(), got.size()));
    EXPECT_EQ(w, got);
    kvc_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    KVC_OK_OR_FAIL(kvc_session_get_stats(s, &st));
    EXPECT_EQ(st.held_bytes, 40 * P);
    EXPECT_EQ(st.allocations_total, 3u);
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 10 * P));  // one FREE
    KVC_OK_OR_FAIL(kvc_session_get_stats(s, &st));
    EXPECT_EQ(st.held_bytes, 30 * P);
    EXPECT_EQ(kvc_session_held_bytes(s), 30 * P);
    // Errors on the channel map through the same status function.
    void *huge = nullptr;
    EXPECT_STATUS(KVC_ERR_RESOURCE_EXHAUSTED, kvc_session_alloc(s, 1024 * MiB, &huge));
    // Concurrent requests from several threads on the one channel.
    std::vector<std::thread> ts;
    std::atomic<int> bad{0};
    for (int t = 0; t < 4; t++)
        ts.emplace_back([&, t] {
            for (int i = 0; i < 10; i++) {
                void *p = nullptr;
                if (kvc_session_alloc(s, (1 + (t + i) % 3) * P, &p) != KVC_OK ||
                    kvc_session_free(s, p) != KVC_OK)
                    bad++;
            }
        });
    for (auto &t : ts)
        t.join();
    EXPECT_EQ(bad.load(), 0) << kvc_last_error();
    kvc_region_destroy(r);
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    KVC_OK_OR_FAIL(kvc_session_get_stats(s, &st));
    EXPECT_EQ(st.held_bytes, 0u);
    uint64_t id = kvc_session_id(s);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));  // CLOSE on the channel
    // The session is gone from the daemon's books.
    kvc_session *s2 = nullptr;
    o.name = "after";
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s2));
    KVC_OK_OR_FAIL(kvc_session_get_stats(s2, &st));
    EXPECT_EQ(st.sessions_open, 1u) << "session " << id << " still open";
    EXPECT_STATUS(KVC_OK, kvc_session_close(s2));
    kvc_client_destroy(c);
}

// One ALLOCATE larger than the socket buffer holds in fds (~12k): the
// library reads the PAGES records while it waits for the REPLY. Its Free
// goes in two FREE records (16384 ids at most in one).
TEST(KvcOwnDaemon, AllocationLargerThanTheSocketBufferOnTheChannel)
{
    if (g_backend != "host")
        GTEST_SKIP() << "host backend only (4 KiB pages)";
    const uint64_t N = 17000;
    struct rlimit rl;
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < N + 1000)
        GTEST_SKIP() << "RLIMIT_NOFILE hard limit " << rl.rlim_max << " < " << N + 1000;
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);  // the fds of one allocation are all open at once
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--page-size", "4096", "--max-pages-per-request", "20000",
                                     "--prealloc", "0"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "big";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    ASSERT_EQ(kvc_session_page_size(s), 4096u);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, N * 4096, &r));
    auto t0 = std::chrono::steady_clock::now();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, N * 4096));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(kvc_region_mapped_bytes(r), N * 4096);
    uint8_t b = 0x77, got = 0;
    KVC_OK_OR_FAIL(kvc_region_write(r, (N - 1) * 4096 + 5, &b, 1));
    KVC_OK_OR_FAIL(kvc_region_read(r, (N - 1) * 4096 + 5, &got, 1));
    EXPECT_EQ(got, 0x77);
    std::printf("allocated %llu pages in one request in %.2f s\n", (unsigned long long)N, secs);
    kvc_region_destroy(r);  // FREE of 16384 ids, then of 616
    kvc_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    KVC_OK_OR_FAIL(kvc_session_get_stats(s, &st));
    EXPECT_EQ(st.held_bytes, 0u);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

TEST(KvcOwnDaemon, ShutdownEndsTheSession)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start());
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "until-shutdown";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(s, [](void *, const kvc_reclaim *) {}, nullptr));
    kvc_region *r = nullptr;
    const uint64_t P = kvc_session_page_size(s);
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * P));
    kill(d.proc.pid, SIGTERM);
    for (int i = 0; i < 100 && !kvc_session_ended(s); i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(kvc_session_ended(s), 1);
    void *p = nullptr;
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_alloc(s, 1, &p));
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_region_map(r, 4 * P, P));
    EXPECT_STATUS(KVC_OK, kvc_region_map(r, 0, 4 * P));  // mapped already: no daemon needed
    kvc_region_destroy(r);  // unmaps locally; the daemon already took the pages
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
    d.stop();
}

// ---- resume after a daemon restart (--state-dir) ----------------------------

bool wait_until(const std::function<bool()> &cond, int ms)
{
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (!cond()) {
        if (std::chrono::steady_clock::now() > until)
            return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
}

kvc_stats own_stats(kvc_session *s)
{
    kvc_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    kvc_status k = kvc_session_get_stats(s, &st);
    EXPECT_EQ(k, KVC_OK) << kvc_last_error();
    return st;
}

std::vector<uint8_t> pattern(uint64_t n, uint8_t seed)
{
    std::vector<uint8_t> v(n);
    for (uint64_t i = 0; i < n; i++)
        v[i] = static_cast<uint8_t>(i * 131 + (i >> 12) + seed);
    return v;
}

void on_reclaim_count(void *user, const kvc_reclaim *) { ++*static_cast<std::atomic<int> *>(user); }

// SIGKILL the daemon while a session holds region pages with data and a
// malloc-style block; everything keeps working locally, daemon calls are
// UNAVAILABLE, a free during the outage is not claimed; restart on the same
// socket and state dir: the same session holds the same pages, data intact,
// the reclaim callback reconnected, new maps and frees work.
TEST(KvcOwnDaemon, SessionResumesAfterDaemonSigkill)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--state-dir", "@STATE@"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "resumer";
    o.max_bytes = 64 * MiB;
    o.priority = 3;
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    EXPECT_EQ(kvc_session_is_resumable(s), 1);
    EXPECT_EQ(kvc_session_is_resuming(s), 0);
    EXPECT_EQ(kvc_session_resume_count(s), 0u);
    KVC_OK_OR_FAIL(kvc_session_wait_resumed(s, 0));  // not resuming: at once
    std::atomic<int> reclaims{0};
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(s, on_reclaim_count, &reclaims));

    const uint64_t P = kvc_session_page_size(s);
    const uint64_t id = kvc_session_id(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 16 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 6 * P));
    const std::vector<uint8_t> data = pattern(6 * P, 7);
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, data.data(), data.size()));
    void *blk = nullptr;
    KVC_OK_OR_FAIL(kvc_session_alloc(s, 2 * P, &blk));
    uint64_t loose = 0;  // a page as a descriptor (API 1.4), freed during the outage
    int loose_fd = -1;
    KVC_OK_OR_FAIL(kvc_session_alloc_pages(s, 1, &loose, &loose_fd));
    ::close(loose_fd);
    kvc_stats before = own_stats(s);
    EXPECT_EQ(before.pages_held, 9u);

    d.proc.kill_and_wait(SIGKILL);
    ASSERT_TRUE(wait_until([&] { return kvc_session_is_resuming(s) == 1; }, 5000));
    EXPECT_EQ(kvc_session_ended(s), 0);
    EXPECT_STATUS(KVC_ERR_UNAVAILABLE, kvc_region_map(r, 8 * P, P));
    std::string msg = kvc_last_error();
    EXPECT_NE(msg.find("is being resumed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("stay usable"), std::string::npos) << msg;
    void *p = nullptr;
    EXPECT_STATUS(KVC_ERR_UNAVAILABLE, kvc_session_alloc(s, P, &p));
    kvc_stats tmp;
    std::memset(&tmp, 0, sizeof tmp);
    tmp.struct_size = sizeof tmp;
    EXPECT_STATUS(KVC_ERR_UNAVAILABLE, kvc_session_get_stats(s, &tmp));
    EXPECT_STATUS(KVC_ERR_DEADLINE_EXCEEDED, kvc_session_wait_resumed(s, 100));
    // Held pages stay usable: read back, write, memset.
    std::vector<uint8_t> got(6 * P);
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, got.data(), got.size()));
    EXPECT_TRUE(got == data);
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, data.data(), P));
    // A free while the daemon is away: checked as the daemon would, then
    // unmapped here and not claimed at resume.
    uint64_t freed = 0;
    uint64_t unknown = 987654321;
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_free_pages(s, &unknown, 1, &freed));
    uint64_t twice[2] = {loose, loose};
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_session_free_pages(s, twice, 2, &freed));
    EXPECT_STATUS(KVC_OK, kvc_session_free_pages(s, &loose, 1, &freed));
    EXPECT_EQ(freed, 1u);
    EXPECT_STATUS(KVC_ERR_NOT_FOUND, kvc_session_free_pages(s, &loose, 1, &freed));  // given back already
    EXPECT_STATUS(KVC_ERR_UNAVAILABLE, kvc_session_alloc_pages(s, 1, &loose, &loose_fd));
    EXPECT_STATUS(KVC_OK, kvc_region_unmap(r, 4 * P, 2 * P));
    EXPECT_EQ(kvc_region_is_mapped(r, 4 * P, 1), 0);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 4 * P);
    EXPECT_EQ(kvc_session_held_bytes(s), 6 * P);

    ASSERT_NO_FATAL_FAILURE(d.restart());
    KVC_OK_OR_FAIL(kvc_session_wait_resumed(s, 60000));
    EXPECT_EQ(kvc_session_is_resuming(s), 0);
    EXPECT_EQ(kvc_session_ended(s), 0);
    EXPECT_EQ(kvc_session_resume_count(s), 1u);
    EXPECT_EQ(kvc_session_id(s), id);
    got.assign(4 * P, 0);
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, got.data(), got.size()));
    EXPECT_TRUE(std::equal(got.begin(), got.end(), data.begin()));
    // The daemon's books: the same session holds the pages it claimed (4
    // region pages and the 2-page block), not the 2 freed during the outage.
    kvc_stats after = own_stats(s);
    EXPECT_EQ(after.pages_held, 6u);
    EXPECT_EQ(after.held_bytes, 6 * P);
    EXPECT_EQ(after.max_bytes, 64 * MiB);
    EXPECT_EQ(after.priority, 3);
    EXPECT_EQ(after.device.pages_in_use, 6u);
    EXPECT_EQ(after.sessions_open, 1u);
    EXPECT_EQ(after.device.pooled_bytes + after.device.in_use_bytes + after.device.free_bytes,
              after.device.budget_bytes);
    // New allocations (zeroed) and frees work.
    KVC_OK_OR_FAIL(kvc_region_map(r, 8 * P, 2 * P));
    std::vector<uint8_t> fresh(2 * P, 0xAA);
    KVC_OK_OR_FAIL(kvc_region_read(r, 8 * P, fresh.data(), fresh.size()));
    EXPECT_TRUE(std::all_of(fresh.begin(), fresh.end(), [](uint8_t b) { return b == 0; }));
    KVC_OK_OR_FAIL(kvc_session_free(s, blk));
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 2 * P, 2 * P));
    after = own_stats(s);
    EXPECT_EQ(after.pages_held, 4u);
    EXPECT_EQ(after.device.pages_in_use, 4u);
    EXPECT_EQ(kvc_session_held_bytes(s), 4 * P);
    // The Watch thread came back: an admin shrink reaches the callback.
    uint64_t asked = 0;
    KVC_OK_OR_FAIL(kvc_session_request_shrink(s, id, 0, 1000, &asked));
    EXPECT_TRUE(wait_until([&] { return reclaims.load() > 0; }, 5000));
    kvc_region_destroy(r);
    EXPECT_EQ(own_stats(s).pages_held, 0u);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
    d.stop();
}

// Threads keep mapping, stamping, checking and unmapping while the daemon
// is SIGKILLed and restarted: only KVC_OK or KVC_ERR_UNAVAILABLE, no stamp
// lost, and afterwards the daemon's books equal what the client maps.
TEST(KvcOwnDaemon, BusyThreadsSurviveADaemonRestart)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--state-dir", "@STATE@"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "busy";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    const int kThreads = 3;
    const uint64_t kPages = 12;
    std::atomic<bool> stop{false};
    std::atomic<int> bad{0}, unavailable{0}, ok{0};
    std::vector<kvc_region *> regions(kThreads, nullptr);
    std::vector<std::string> errors(kThreads);
    for (int t = 0; t < kThreads; t++)
        KVC_OK_OR_FAIL(kvc_region_create(s, kPages * P, &regions[t]));
    auto work = [&](int t) {
        kvc_region *r = regions[t];
        std::vector<uint8_t> stamp(kPages, 0);  // 0: not mapped by us
        uint32_t seed = 12345u + t;
        uint64_t word;
        while (!stop.load()) {
            seed = seed * 1103515245u + 12345u;
            uint64_t k = (seed >> 8) % kPages;
            if (!stamp[k]) {
                kvc_status st = kvc_region_map(r, k * P, P);
                if (st == KVC_ERR_UNAVAILABLE) {
                    unavailable++;
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    continue;
                }
                if (st != KVC_OK) {
                    errors[t] = std::string("map: ") + kvc_status_to_string(st) + ": " + kvc_last_error();
                    bad++;
                    return;
                }
                uint8_t v = static_cast<uint8_t>(1 + (seed >> 16) % 250);
                word = v * 0x0101010101010101ull;
                if (kvc_region_read(r, k * P, &word, 8) != KVC_OK || word != 0) {
                    errors[t] = "fresh page not zero";
                    bad++;
                    return;
                }
                word = v * 0x0101010101010101ull;
                kvc_region_write(r, k * P + P - 8, &word, 8);
                stamp[k] = v;
                ok++;
            } else {
                if (kvc_region_read(r, k * P + P - 8, &word, 8) != KVC_OK ||
                    word != stamp[k] * 0x0101010101010101ull) {
                    errors[t] = "stamp lost on page " + std::to_string(k);
                    bad++;
                    return;
                }
                if ((seed >> 20) % 2) {
                    kvc_status st = kvc_region_unmap(r, k * P, P);
                    if (st != KVC_OK) {
                        errors[t] = std::string("unmap: ") + kvc_status_to_string(st) + ": " + kvc_last_error();
                        bad++;
                        return;
                    }
                    stamp[k] = 0;
                }
            }
        }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; t++)
        threads.emplace_back(work, t);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    d.proc.kill_and_wait(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    d.restart();
    EXPECT_STATUS(KVC_OK, kvc_session_wait_resumed(s, 60000));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    stop = true;
    for (auto &th : threads)
        th.join();
    for (int t = 0; t < kThreads; t++)
        EXPECT_TRUE(errors[t].empty()) << "thread " << t << ": " << errors[t];
    EXPECT_EQ(bad.load(), 0);
    EXPECT_GT(ok.load(), 0);
    EXPECT_GT(unavailable.load(), 0);
    EXPECT_EQ(kvc_session_resume_count(s), 1u);
    uint64_t mapped = 0;
    for (auto *r : regions)
        mapped += kvc_region_mapped_bytes(r);
    EXPECT_EQ(kvc_session_held_bytes(s), mapped);
    kvc_stats st = own_stats(s);
    EXPECT_EQ(st.held_bytes, mapped);
    EXPECT_EQ(st.device.in_use_bytes, mapped);
    for (auto *r : regions)
        kvc_region_destroy(r);
    EXPECT_EQ(own_stats(s).pages_held, 0u);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
    d.stop();
}

// The daemon dies between a Free's unmap and its send: the FREE meets the
// closed socket (EPIPE) before anyone has read the hang-up. The Free is
// deferred like any Free during an outage: the unmap succeeds and its pages
// are not claimed at the resume (a plain UNAVAILABLE there would leave the
// unmapped pages claimed and held until the session ends). The daemon is
// killed and reaped inside sendmsg, right before the FREE goes out, while
// the session's monitor thread is held off the channel.
TEST(KvcOwnDaemon, FreeWhoseSendMeetsTheDeadDaemonIsDeferred)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--state-dir", "@STATE@"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "epipe";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * P));
    g_killed_on_free = 0;
    g_hold_monitor = 1;
    g_kill_on_free = d.proc.pid;
    EXPECT_STATUS(KVC_OK, kvc_region_unmap(r, 2 * P, 6 * P));
    g_kill_on_free = -1;
    g_hold_monitor = 0;
    ASSERT_EQ(g_killed_on_free.load(), 1) << "no FREE was sent";
    d.proc.pid = -1;  // reaped in sendmsg
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    EXPECT_EQ(kvc_session_held_bytes(s), 2 * P);
    ASSERT_TRUE(wait_until([&] { return kvc_session_is_resuming(s) == 1; }, 5000));
    ASSERT_NO_FATAL_FAILURE(d.restart());
    KVC_OK_OR_FAIL(kvc_session_wait_resumed(s, 60000));
    kvc_stats after = own_stats(s);
    EXPECT_EQ(after.pages_held, 2u);  // not the 6 freed
    EXPECT_EQ(after.device.pages_in_use, 2u);
    kvc_region_destroy(r);
    EXPECT_EQ(own_stats(s).pages_held, 0u);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
    d.stop();
}

// The daemon comes back without its journal: the claim is refused and the
// session ends with a status that says so; mapped memory stays readable.
TEST(KvcOwnDaemon, RefusedResumeEndsTheSession)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--state-dir", "@STATE@"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "refused";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 4 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * P));
    const std::vector<uint8_t> data = pattern(2 * P, 1);
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, data.data(), data.size()));
    d.proc.kill_and_wait(SIGKILL);
    ASSERT_TRUE(wait_until([&] { return kvc_session_is_resuming(s) == 1; }, 5000));
    std::string rm = "rm -rf '" + d.dir + "/state'";
    ASSERT_EQ(std::system(rm.c_str()), 0);
    ASSERT_NO_FATAL_FAILURE(d.restart());
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_wait_resumed(s, 60000));
    std::string msg = kvc_last_error();
    // docs/protocol.md "Hang-up and resume": the spec's words, then the
    // restarted daemon's own message.
    const std::string head = "session " + std::to_string(kvc_session_id(s)) +
                             " could not be resumed after the daemon restarted: ";
    EXPECT_EQ(msg.rfind(head, 0), 0u) << msg;
    EXPECT_GT(msg.size(), head.size()) << msg;
    EXPECT_EQ(kvc_session_ended(s), 1);
    EXPECT_EQ(kvc_session_is_resuming(s), 0);
    void *p = nullptr;
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_alloc(s, 1, &p));
    EXPECT_EQ(std::string(kvc_last_error()), msg);  // every later call: the same end
    std::vector<uint8_t> got(2 * P);
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, got.data(), got.size()));
    EXPECT_TRUE(got == data);
    kvc_region_destroy(r);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
    d.stop();
}

// Without --state-dir there is no resume token: the session ends.
TEST(KvcOwnDaemon, WithoutStateDirNoResume)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start());
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "no-state";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    EXPECT_EQ(kvc_session_is_resumable(s), 0);
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_wait_resumed(s, 0));
    EXPECT_NE(std::string(kvc_last_error()).find("--state-dir"), std::string::npos);
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 4 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, P));
    d.proc.kill_and_wait(SIGKILL);
    ASSERT_NO_FATAL_FAILURE(d.restart());
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_region_map(r, P, P));
    EXPECT_EQ(kvc_session_ended(s), 1);
    EXPECT_EQ(kvc_session_is_resuming(s), 0);
    EXPECT_EQ(kvc_session_resume_count(s), 0u);
    kvc_region_destroy(r);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
    d.stop();
}

// No state dir: the session ends with the daemon; its region keeps the
// pages it had mapped (readable), and kvc_region_rebind moves it to a session
// of the restarted daemon: new pages come from there, the old ones are
// unmapped locally (no daemon counts them), the old session can be closed.
TEST(KvcOwnDaemon, RegionRebindAfterDaemonRestart)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start());
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "before";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * P));
    std::vector<uint8_t> data = pattern(2 * P, 7), back(2 * P);
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, data.data(), data.size()));
    // a live session's region cannot be rebound
    o.name = "other";
    kvc_session *other = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &other));
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_region_rebind(r, other));
    EXPECT_NE(std::string(kvc_last_error()).find("still live"), std::string::npos) << kvc_last_error();

    d.proc.kill_and_wait(SIGKILL);
    ASSERT_NO_FATAL_FAILURE(d.restart());
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_region_map(r, 2 * P, P));
    ASSERT_EQ(kvc_session_ended(s), 1);
    kvc_client *c2 = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c2));
    o.name = "after";
    kvc_session *s2 = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c2, &o, &s2));
    KVC_OK_OR_FAIL(kvc_region_rebind(r, s2));
    KVC_OK_OR_FAIL(kvc_region_rebind(r, s2));  // again: nothing to do
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));  // no region uses it any more
    // the old pages are still there, with their data
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, back.data(), back.size()));
    EXPECT_EQ(data, back);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    EXPECT_EQ(own_stats(s2).pages_held, 0u) << "the orphaned pages are no daemon's";
    // new memory from the new daemon, zeroed
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * P));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 4 * P);
    EXPECT_EQ(own_stats(s2).pages_held, 2u);
    KVC_OK_OR_FAIL(kvc_region_read(r, 2 * P, back.data(), P));
    for (uint64_t i = 0; i < P; i++)
        ASSERT_EQ(back[i], 0) << i;
    // the orphans go without a Free; the new pages with one
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 2 * P));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 2 * P);
    EXPECT_EQ(own_stats(s2).pages_held, 2u);
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_close(s2));  // the region is its now
    kvc_region_destroy(r);
    kvc_stats st = own_stats(s2);
    EXPECT_EQ(st.pages_held, 0u);
    EXPECT_EQ(st.device.pooled_bytes + st.device.in_use_bytes + st.device.free_bytes, st.device.budget_bytes);

    // another daemon with other pages: refused, naming them
    Daemon d4;
    ASSERT_NO_FATAL_FAILURE(d4.start({"--page-size", "4MiB"}));
    kvc_client *c4 = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d4.sock.c_str(), &c4));
    o.name = "bigger-pages";
    kvc_session *s4 = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c4, &o, &s4));
    kvc_region *r2 = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s2, 4 * P, &r2));
    d.proc.kill_and_wait(SIGKILL);
    ASSERT_TRUE(wait_until([&] { return kvc_region_map(r2, 0, P) != KVC_OK && kvc_session_ended(s2); }, 10000));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_rebind(r2, s4));
    EXPECT_NE(std::string(kvc_last_error()).find("pages of"), std::string::npos) << kvc_last_error();
    kvc_region_destroy(r2);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s2));
    EXPECT_STATUS(KVC_OK, kvc_session_close(s4));
    kvc_session_close(other);
    kvc_client_destroy(c4);
    kvc_client_destroy(c2);
    kvc_client_destroy(c);
    d4.stop();
}

// Local pages (API 1.5): the process's own memory in a region, no daemon
// asked: while the daemon is gone, after a restart beside the new daemon's
// pages, and freed by unmapping with no Free.
TEST(KvcOwnDaemon, LocalPagesNeedNoDaemon)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start());
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "local";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, P));  // one daemon page
    const uint64_t allocs0 = own_stats(s).allocations_total;
    // [0, 3P): page 0 is the daemon's already; 1 and 2 become local
    kvc_range three = {0, 3 * P};
    KVC_OK_OR_FAIL(kvc_region_map_ranges_local(r, &three, 1));
    EXPECT_EQ(kvc_region_mapped_bytes(r), 3 * P);
    EXPECT_EQ(kvc_region_local_bytes(r), 2 * P);
    EXPECT_EQ(own_stats(s).allocations_total, allocs0) << "a local page asked the daemon";
    EXPECT_EQ(own_stats(s).pages_held, 1u);
    EXPECT_TRUE(kvc_region_is_mapped(r, 0, 3 * P));
    std::vector<uint8_t> data = pattern(2 * P, 3), back(2 * P);
    KVC_OK_OR_FAIL(kvc_region_read(r, P, back.data(), 2 * P));
    for (uint64_t i = 0; i < 2 * P; i++)
        ASSERT_EQ(back[i], 0) << "a new local page is not zero at " << i;
    KVC_OK_OR_FAIL(kvc_region_write(r, P / 2, data.data(), data.size()));  // across both kinds
    KVC_OK_OR_FAIL(kvc_region_read(r, P / 2, back.data(), back.size()));
    EXPECT_EQ(data, back);
    // a daemon map over them asks only for the pages still missing
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * P));
    EXPECT_EQ(own_stats(s).pages_held, 2u);
    EXPECT_EQ(kvc_region_local_bytes(r), 2 * P);
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_map(r, 0, 9 * P));
    kvc_range outside = {7 * P, 2 * P};
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_map_ranges_local(r, &outside, 1));
    EXPECT_STATUS(KVC_ERR_INVALID_ARGUMENT, kvc_region_map_ranges_local(r, nullptr, 1));

    // the daemon is gone: no daemon page, but local ones still come
    d.proc.kill_and_wait(SIGKILL);
    ASSERT_TRUE(wait_until([&] { return kvc_session_ended(s) == 1; }, 5000));
    EXPECT_NE(kvc_region_map(r, 4 * P, P), KVC_OK);
    kvc_range more = {4 * P, 2 * P};
    KVC_OK_OR_FAIL(kvc_region_map_ranges_local(r, &more, 1));
    EXPECT_EQ(kvc_region_local_bytes(r), 4 * P);
    KVC_OK_OR_FAIL(kvc_region_write(r, 4 * P, data.data(), data.size()));
    KVC_OK_OR_FAIL(kvc_region_read(r, 4 * P, back.data(), back.size()));
    EXPECT_EQ(data, back);
    // cells freed while the daemon is away: local pages go, the daemon's stay
    kvc_range tail = {3 * P, 3 * P};  // pages 3 (the daemon's), 4, 5 (local)
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_local(r, &tail, 1));
    EXPECT_EQ(kvc_region_local_bytes(r), 2 * P);
    EXPECT_TRUE(kvc_region_is_mapped(r, 3 * P, P));
    EXPECT_FALSE(kvc_region_is_mapped(r, 4 * P, 1));
    KVC_OK_OR_FAIL(kvc_region_map_ranges_local(r, &more, 1));
    EXPECT_EQ(kvc_region_local_bytes(r), 4 * P);

    // a new daemon: the region moves to a new session, local pages stay local
    ASSERT_NO_FATAL_FAILURE(d.restart());
    kvc_client *c2 = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c2));
    kvc_session *s2 = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c2, &o, &s2));
    KVC_OK_OR_FAIL(kvc_region_rebind(r, s2));
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    EXPECT_EQ(kvc_region_local_bytes(r), 4 * P);
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 7 * P));  // page 6 from the new daemon
    EXPECT_EQ(own_stats(s2).pages_held, 1u);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 7 * P);
    // unmapping frees local pages with no Free (the new daemon lent none of them)
    const uint64_t frees0 = own_stats(s2).frees_total;
    KVC_OK_OR_FAIL(kvc_region_unmap(r, P, 2 * P));
    EXPECT_EQ(kvc_region_local_bytes(r), 2 * P);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 5 * P);
    EXPECT_EQ(own_stats(s2).frees_total, frees0);
    EXPECT_FALSE(kvc_region_is_mapped(r, P, 1));
    // mapped again from the daemon: fresh, zeroed
    KVC_OK_OR_FAIL(kvc_region_map(r, P, P));
    KVC_OK_OR_FAIL(kvc_region_read(r, P, back.data(), P));
    for (uint64_t i = 0; i < P; i++)
        ASSERT_EQ(back[i], 0) << i;
    EXPECT_EQ(own_stats(s2).pages_held, 2u);
    kvc_region_destroy(r);
    kvc_stats st = own_stats(s2);
    EXPECT_EQ(st.pages_held, 0u);
    EXPECT_EQ(st.device.pooled_bytes + st.device.in_use_bytes + st.device.free_bytes, st.device.budget_bytes);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s2));
    kvc_client_destroy(c2);
    kvc_client_destroy(c);
}

// A watched session (reclaim callback set) that cannot be resumed notices
// at once that its daemon died: ended without any call of its own.
TEST(KvcOwnDaemon, WatchedSessionEndsWhenItsDaemonDies)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start());
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "watched";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    std::atomic<int> calls{0};
    KVC_OK_OR_FAIL(kvc_session_set_reclaim_callback(s, on_reclaim_count, &calls));
    EXPECT_EQ(kvc_session_ended(s), 0);
    d.proc.kill_and_wait(SIGKILL);
    EXPECT_TRUE(wait_until([&] { return kvc_session_ended(s) == 1; }, 5000)) << "not noticed";
    kvc_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_session_get_stats(s, &st));
    const std::string why = kvc_last_error();
    EXPECT_NE(why.find("ended: the daemon went away, and without a state dir"), std::string::npos) << why;
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

// CUDA test driver only: the local driver and the daemon's backend failing,
// made by its fault injection (KVCACHED_TESTDRV_FAIL) and checked with its
// leak report. CMake filters it out of the host run (*OnCuda); the GPU
// bundle's stage 2 out of a run on NVIDIA's driver (*TestDriver*), where
// faults cannot be injected.
TEST(KvcOwnDaemon, TestDriverFaultsOnCuda)
{
    ASSERT_EQ(g_backend, "cuda") << "this test needs the CUDA test driver";
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--prealloc", "0"},
                                    {"KVCACHED_TESTDRV_FAIL=cuMemCreate:1:CUDA_ERROR_INVALID_VALUE"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "driver";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    void *p = nullptr;
    EXPECT_STATUS(KVC_ERR_INTERNAL, kvc_session_alloc(s, 1, &p));
    EXPECT_NE(std::string(kvc_last_error()).find("CUDA_ERROR_INVALID_VALUE"), std::string::npos)
        << kvc_last_error();
    KVC_OK_OR_FAIL(kvc_session_alloc(s, 1, &p));  // the next create works
    KVC_OK_OR_FAIL(kvc_session_free(s, p));

    // A client that cannot load the driver.
    int code = 0;
    std::string out = run({g_helper, "open", d.sock}, {"KVCACHED_LIBCUDA=/nonexistent/libcuda.so.1"},
                          &code);
    EXPECT_EQ(out.rfind("STATUS KVC_ERR_DRIVER", 0), 0u) << out;
    // A client whose cuMemMap fails on the 2nd page: nothing stays mapped or held.
    out = run({g_helper, "map", d.sock, "3"}, {"KVCACHED_TESTDRV_FAIL=cuMemMap:2"}, &code);
    EXPECT_EQ(out.rfind("STATUS KVC_ERR_DRIVER", 0), 0u) << out;
    EXPECT_NE(out.find("cuMemMap"), std::string::npos) << out;
    EXPECT_NE(out.find("HELD 0"), std::string::npos) << out;
    auto read_report = [](const std::string &path) {
        std::ifstream f(path);
        std::stringstream ss;
        ss << f.rdbuf();
        return ss.str();
    };
    // A run of pages is mapped all or nothing: the access for the run, or
    // the import of its 2nd page, failing leaves nothing mapped, held or
    // open (the test driver's report).
    for (const char *fault : {"cuMemSetAccess:1", "cuMemImportFromShareableHandle:2", "cuMemMap:3"}) {
        std::string rep = d.dir + "/fault-report.json";
        out = run({g_helper, "map", d.sock, "3"},
                  {std::string("KVCACHED_TESTDRV_FAIL=") + fault, "KVCACHED_TESTDRV_REPORT=" + rep}, &code);
        const std::string fn = std::string(fault).substr(0, std::string(fault).find(':'));
        EXPECT_EQ(out.rfind("STATUS KVC_ERR_DRIVER", 0), 0u) << fault << ": " << out;
        EXPECT_NE(out.find(fn), std::string::npos) << out;
        EXPECT_NE(out.find("HELD 0"), std::string::npos) << fault << ": " << out;
        EXPECT_NE(read_report(rep).find("\"leaks\": 0"), std::string::npos) << fault << ": " << read_report(rep);
    }
    // A clean client leaks no driver object (the test driver's report), and
    // sets access once for the 3 consecutive pages it mapped.
    std::string report = d.dir + "/client-report.json";
    out = run({g_helper, "map", d.sock, "3"}, {"KVCACHED_TESTDRV_REPORT=" + report}, &code);
    EXPECT_EQ(out.rfind("STATUS KVC_OK", 0), 0u) << out;
    const std::string rep = read_report(report);
    EXPECT_NE(rep.find("\"leaks\": 0"), std::string::npos) << rep;
    EXPECT_NE(rep.find("\"cuMemMap\": 3"), std::string::npos) << rep;
    EXPECT_NE(rep.find("\"cuMemSetAccess\": 1"), std::string::npos) << rep;
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

// Kept handles (docs/protocol.md "Kept handles", API 1.6) against a real
// daemon on CUDA. This process's driver calls are read from the test
// driver's live call counters (KVCACHED_TESTDRV_CALLS, set in main for the
// CUDA run); on another libcuda the file is absent and only the session's
// own count (kvc_session_kept_handles) is checked.
struct DriverCalls {
    uint64_t import = 0, map = 0, release = 0, unmap = 0;
    uint64_t total = 0;  // every driver call of this process
    bool known = false;
};

// This process's calls, or (pid) another's of this run: the counters stay
// after it exited.
DriverCalls driver_calls(pid_t pid = getpid())
{
    DriverCalls c;
    const char *dir = std::getenv("KVCACHED_TESTDRV_CALLS");
    if (!dir)
        return c;
    std::ifstream f(std::string(dir) + "/" + std::to_string(pid), std::ios::binary);
    std::string b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (b.size() < 32)
        return c;
    uint32_t nfn, namelen;
    std::memcpy(&nfn, b.data() + 12, 4);
    std::memcpy(&namelen, b.data() + 20, 4);
    if (b.size() < 32 + size_t(nfn) * (namelen + 8))
        return c;
    for (uint32_t i = 0; i < nfn; i++) {
        std::string name(b.data() + 32 + size_t(i) * namelen);
        uint64_t v;
        std::memcpy(&v, b.data() + 32 + size_t(nfn) * namelen + 8 * size_t(i), 8);
        c.total += v;
        if (name == "cuMemImportFromShareableHandle")
            c.import = v;
        else if (name == "cuMemMap")
            c.map = v;
        else if (name == "cuMemRelease")
            c.release = v;
        else if (name == "cuMemUnmap")
            c.unmap = v;
    }
    c.known = true;
    return c;
}

// The CUDA run's libcuda is the project's test driver: its counters must be there.
bool on_test_driver()
{
    const char *lib = std::getenv("KVCACHED_LIBCUDA");
    return lib && std::string(lib).find("testdriver") != std::string::npos;
}

// A page that comes back to the session that freed it is mapped from the
// handle it kept: no import, no release; its bytes are the daemon's zeros
// all the same. The session's end releases every kept handle.
TEST(KvcOwnDaemon, KeptHandleMapsAReturningPageWithoutImportOnCuda)
{
    ASSERT_EQ(g_backend, "cuda") << "kept handles are CUDA's";
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--prealloc", "0"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "kept";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t page = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 4 * page, &r));
    EXPECT_EQ(kvc_session_kept_handles(s), 0u);

    DriverCalls a = driver_calls();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * page));
    DriverCalls b = driver_calls();
    ASSERT_TRUE(a.known || !on_test_driver()) << "no live call counters from the test driver";
    EXPECT_EQ(kvc_session_kept_handles(s), 4u);  // imported and kept
    if (a.known) {
        EXPECT_EQ(b.import - a.import, 4u);
        EXPECT_EQ(b.release - a.release, 0u);  // kept, not released
    }
    const char stamp[] = "first loan";
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, stamp, sizeof stamp));
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 4 * page));  // FREE with keep
    EXPECT_EQ(kvc_session_kept_handles(s), 4u);

    a = driver_calls();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * page));  // the same pages come back (last in, first out)
    b = driver_calls();
    EXPECT_EQ(kvc_session_kept_handles(s), 4u);
    if (a.known) {
        EXPECT_EQ(b.import - a.import, 0u) << "a returning page was imported again";
        EXPECT_EQ(b.release - a.release, 0u);
        EXPECT_EQ(b.map - a.map, 4u);
    } else {
        GTEST_LOG_(INFO) << "no test driver call counters: imports not counted";
    }
    char got[sizeof stamp];
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, got, sizeof got));
    EXPECT_EQ(std::string(got, sizeof got), std::string(sizeof got, '\0'));  // zeroed all the same
    const char again[] = "second loan";
    KVC_OK_OR_FAIL(kvc_region_write(r, page, again, sizeof again));
    char got2[sizeof again];
    KVC_OK_OR_FAIL(kvc_region_read(r, page, got2, sizeof got2));
    EXPECT_STREQ(got2, again);
    kvc_stats st;
    std::memset(&st, 0, sizeof st);
    st.struct_size = sizeof st;
    KVC_OK_OR_FAIL(kvc_session_get_stats(s, &st));
    EXPECT_EQ(st.pages_held, 4u);
    kvc_region_destroy(r);  // unmapped and freed (with keep)
    EXPECT_EQ(kvc_session_kept_handles(s), 4u);
    a = driver_calls();
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));  // every kept handle released
    b = driver_calls();
    if (a.known)
        EXPECT_EQ(b.release - a.release, 4u);

    // KVCACHED_KEEP_HANDLES=0 (read at session open): nothing is kept.
    setenv("KVCACHED_KEEP_HANDLES", "0", 1);
    o.name = "unkept";
    s = nullptr;
    kvc_status opened = kvc_session_open(c, &o, &s);
    unsetenv("KVCACHED_KEEP_HANDLES");
    KVC_OK_OR_FAIL(opened);
    KVC_OK_OR_FAIL(kvc_region_create(s, 2 * page, &r));
    a = driver_calls();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * page));
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 2 * page));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * page));
    b = driver_calls();
    EXPECT_EQ(kvc_session_kept_handles(s), 0u);
    if (a.known) {
        EXPECT_EQ(b.import - a.import, 4u);
        EXPECT_EQ(b.release - a.release, 4u);
    }
    kvc_region_destroy(r);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

// The daemon asks for kept handles before it releases the pages (here the
// idle trim, --pool-idle-seconds 0): the session's reader answers the DROP
// by itself, with no call waiting: it releases the handles and sends
// DROPPED, and the daemon then releases the pages. A page mapped later is
// imported (and kept) anew.
TEST(KvcOwnDaemon, DropReleasesKeptHandlesOnCuda)
{
    ASSERT_EQ(g_backend, "cuda") << "kept handles are CUDA's";
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--prealloc", "0", "--pool-idle-seconds", "0"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "dropped";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t page = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 3 * page, &r));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 3 * page));
    EXPECT_EQ(kvc_session_kept_handles(s), 3u);
    DriverCalls a = driver_calls();
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 3 * page));  // kept; the trim asks for them
    EXPECT_TRUE(wait_until([&] { return kvc_session_kept_handles(s) == 0; }, 5000))
        << "the DROP was not answered: " << kvc_session_kept_handles(s) << " handles kept";
    DriverCalls b = driver_calls();
    if (a.known)
        EXPECT_EQ(b.release - a.release, 3u);
    auto pooled = [&] {
        kvc_stats st;
        std::memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        if (kvc_session_get_stats(s, &st) != KVC_OK)
            return ~0ull;
        return static_cast<unsigned long long>(st.device.pooled_bytes);
    };
    EXPECT_TRUE(wait_until([&] { return pooled() == 0; }, 5000))
        << "the pages were not released after DROPPED: " << pooled() << " bytes pooled";
    EXPECT_EQ(kvc_session_ended(s), 0) << kvc_last_error();  // answered in time
    a = driver_calls();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, page));  // a new page: imported and kept
    b = driver_calls();
    EXPECT_EQ(kvc_session_kept_handles(s), 1u);
    if (a.known)
        EXPECT_EQ(b.import - a.import, 1u);
    kvc_region_destroy(r);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

// Standby pages (docs/protocol.md "Standby pages", API 1.7), on the host
// backend and on CUDA (the test driver's call counters): pages unmapped as
// standby stay mapped and the session's (SessionStats.standby_bytes), keep
// their bytes, and come back with no Allocate and no driver call; the limit
// is honoured; release_standby, a plain unmap and destroy give them back.
TEST(KvcOwnDaemon, StandbyPagesComeBackWithoutAllocate)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--prealloc", "0"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "standby";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t page = kvc_session_page_size(s);
    auto stats = [&] {
        kvc_stats st;
        std::memset(&st, 0, sizeof st);
        st.struct_size = sizeof st;
        EXPECT_EQ(kvc_session_get_stats(s, &st), KVC_OK) << kvc_last_error();
        EXPECT_EQ(st.struct_size, sizeof st);
        return st;
    };
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * page, &r));
    EXPECT_EQ(kvc_region_standby_limit(r), 0u);
    KVC_OK_OR_FAIL(kvc_region_set_standby_limit(r, 4 * page));
    EXPECT_EQ(kvc_region_standby_limit(r), 4 * page);
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    const char stamp[] = "kept as standby";
    KVC_OK_OR_FAIL(kvc_region_write(r, page, stamp, sizeof stamp));

    // One range of 8 pages, room for 4: the first 4 stay as standby.
    kvc_range all = {0, 8 * page};
    kvc_stats s0 = stats();
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, &all, 1));
    EXPECT_EQ(kvc_region_standby_bytes(r), 4 * page);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 0u);  // unmapped from the caller's view
    EXPECT_EQ(kvc_region_is_mapped(r, 0, page), 0);
    char got[sizeof stamp];
    EXPECT_STATUS(KVC_ERR_FAILED_PRECONDITION, kvc_region_read(r, page, got, sizeof got));
    KVC_OK_OR_FAIL(kvc_region_clear(r, 0xff));  // skips standby pages
    kvc_stats s1 = stats();
    EXPECT_EQ(s1.standby_bytes, 4 * page);
    EXPECT_EQ(s1.device_standby_bytes, 4 * page);
    EXPECT_EQ(s1.held_bytes, 4 * page);  // standby pages are held
    EXPECT_EQ(s1.allocations_total, s0.allocations_total);
    EXPECT_EQ(kvc_session_held_bytes(s), 4 * page);

    // Mapped again: no Allocate, no driver call, the bytes as they were.
    DriverCalls a = driver_calls();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * page));
    DriverCalls b = driver_calls();
    if (g_backend == "cuda") {
        ASSERT_TRUE(a.known || !on_test_driver()) << "no live call counters from the test driver";
        if (a.known)
            EXPECT_EQ(b.total - a.total, 0u) << "a re-map from standby called the driver";
    }
    EXPECT_EQ(kvc_region_standby_bytes(r), 0u);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 4 * page);
    KVC_OK_OR_FAIL(kvc_region_read(r, page, got, sizeof got));
    EXPECT_STREQ(got, stamp);  // not zeroed (and not cleared by kvc_region_clear)
    EXPECT_TRUE(wait_until([&] { return stats().standby_bytes == 0; }, 5000))
        << "the USE record did not reach the daemon";
    kvc_stats s2 = stats();
    EXPECT_EQ(s2.allocations_total, s1.allocations_total) << "a re-map from standby allocated";
    EXPECT_EQ(s2.held_bytes, 4 * page);

    // A map of standby and missing pages allocates only the missing ones.
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, &all, 1));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 6 * page));
    kvc_stats s3 = stats();
    EXPECT_EQ(s3.allocations_total, s2.allocations_total + 1);
    EXPECT_EQ(s3.held_bytes, 6 * page);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 6 * page);

    // Several ranges: the front of every range in turn.
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    kvc_range two[2] = {{0, 4 * page}, {4 * page, 4 * page}};
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, two, 2));
    EXPECT_EQ(kvc_region_standby_bytes(r), 4 * page);
    kvc_stats s4 = stats();
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 2 * page));
    KVC_OK_OR_FAIL(kvc_region_map(r, 4 * page, 2 * page));
    EXPECT_EQ(kvc_region_standby_bytes(r), 0u);
    EXPECT_EQ(stats().allocations_total, s4.allocations_total);

    // release_standby gives back what was asked (rounded up to pages).
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, &all, 1));
    EXPECT_EQ(kvc_region_standby_bytes(r), 4 * page);
    uint64_t released = 0;
    KVC_OK_OR_FAIL(kvc_region_release_standby(r, page + 1, &released));
    EXPECT_EQ(released, 2 * page);
    EXPECT_EQ(kvc_region_standby_bytes(r), 2 * page);
    EXPECT_EQ(stats().held_bytes, 2 * page);
    // A lower limit frees the excess; a plain unmap frees standby pages.
    KVC_OK_OR_FAIL(kvc_region_set_standby_limit(r, page));
    EXPECT_EQ(kvc_region_standby_bytes(r), page);
    EXPECT_EQ(stats().held_bytes, page);
    KVC_OK_OR_FAIL(kvc_region_unmap(r, 0, 8 * page));
    EXPECT_EQ(kvc_region_standby_bytes(r), 0u);
    kvc_stats s5 = stats();
    EXPECT_EQ(s5.held_bytes, 0u);
    EXPECT_EQ(s5.standby_bytes, 0u);

    // Limit 0: exactly kvc_region_unmap_ranges.
    KVC_OK_OR_FAIL(kvc_region_set_standby_limit(r, 0));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, &all, 1));
    EXPECT_EQ(kvc_region_standby_bytes(r), 0u);
    EXPECT_EQ(stats().held_bytes, 0u);

    // Destroy gives standby pages back too.
    KVC_OK_OR_FAIL(kvc_region_set_standby_limit(r, 8 * page));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, &all, 1));
    EXPECT_EQ(kvc_region_standby_bytes(r), 8 * page);
    EXPECT_EQ(stats().standby_bytes, 8 * page);
    kvc_region_destroy(r);
    kvc_stats s6 = stats();
    EXPECT_EQ(s6.held_bytes, 0u);
    EXPECT_EQ(s6.standby_bytes, 0u);
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);
}

// A region gives back each run of adjacent pages with one cuMemUnmap over
// the run (kvc_region_unmap*, the standby variants, release_standby,
// destroy), local pages in a run too (the test driver's live call
// counters). The failure cases run in helper processes whose cuMemUnmap
// calls are refused (KVCACHED_TESTDRV_FAIL): a refused run is unmapped
// page by page and everything freed; a page that cannot be unmapped stays
// mapped and held (not freed), and the error is returned.
TEST(KvcOwnDaemon, UnmapsRunsOfAdjacentPagesOnCuda)
{
    ASSERT_EQ(g_backend, "cuda") << "this test counts the CUDA test driver's calls";
    ASSERT_TRUE(on_test_driver()) << "needs the test driver's call counters";
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--prealloc", "0"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "unmap-runs";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t page = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * page, &r));
    auto unmaps = [&](const std::function<kvc_status()> &f) {
        DriverCalls a = driver_calls();
        kvc_status st = f();
        EXPECT_EQ(st, KVC_OK) << kvc_last_error();
        return driver_calls().unmap - a.unmap;
    };
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    // One run: one call.
    EXPECT_EQ(unmaps([&] { return kvc_region_unmap(r, page, 3 * page); }), 1u);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 5 * page);
    EXPECT_EQ(kvc_session_held_bytes(s), 5 * page);
    // Two runs (pages 0-1 and 3-7): two calls.
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    kvc_range two[2] = {{0, 2 * page}, {3 * page, 5 * page}};
    EXPECT_EQ(unmaps([&] { return kvc_region_unmap_ranges(r, two, 2); }), 2u);
    EXPECT_EQ(kvc_region_mapped_bytes(r), page);
    // A local page in a run (page 1 between daemon pages 0 and 2): one call,
    // its count right.
    kvc_range local = {page, page};
    KVC_OK_OR_FAIL(kvc_region_map_ranges_local(r, &local, 1));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 3 * page));
    EXPECT_EQ(kvc_region_local_bytes(r), page);
    EXPECT_EQ(unmaps([&] { return kvc_region_unmap(r, 0, 3 * page); }), 1u);
    EXPECT_EQ(kvc_region_local_bytes(r), 0u);
    EXPECT_EQ(kvc_region_mapped_bytes(r), 0u);
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    // Standby: the pages past the limit (4-7) go in one call; release_standby
    // of adjacent standby pages is one call; destroy of everything is one.
    KVC_OK_OR_FAIL(kvc_region_set_standby_limit(r, 4 * page));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 8 * page));
    kvc_range all = {0, 8 * page};
    EXPECT_EQ(unmaps([&] { return kvc_region_unmap_ranges_standby(r, &all, 1); }), 1u);
    EXPECT_EQ(kvc_region_standby_bytes(r), 4 * page);
    uint64_t released = 0;
    EXPECT_EQ(unmaps([&] { return kvc_region_release_standby(r, 2 * page, &released); }), 1u);
    EXPECT_EQ(released, 2 * page);
    KVC_OK_OR_FAIL(kvc_region_map(r, 2 * page, 6 * page));
    EXPECT_EQ(unmaps([&] {
                  kvc_region_destroy(r);
                  return KVC_OK;
              }),
              1u);
    EXPECT_EQ(kvc_session_held_bytes(s), 0u);
    EXPECT_STATUS(KVC_OK, kvc_session_close(s));
    kvc_client_destroy(c);

    // The helper maps pages 0, 1, 3 from the daemon and 2 as a local page,
    // unmaps pages 0-2 (one run), then destroys the region.
    struct Case {
        const char *fail;
        const char *status, *books;
        uint64_t unmaps;
    } cases[] = {
        // the run (1, refused), pages 0, 1, 2 (2-4); destroy: page 3 (5)
        {"cuMemUnmap:1", "STATUS KVC_OK", "MAPPED 1 LOCAL 0 HELD 1 PAGES", 5},
        // the run (1, refused), page 0 (2), page 1 (3, refused: still
        // mapped and held), page 2 (4); destroy: pages 1 and 3 (5, 6)
        {"cuMemUnmap:1,cuMemUnmap:3", "STATUS KVC_ERR_DRIVER", "MAPPED 2 LOCAL 0 HELD 2 PAGES", 6},
    };
    for (const Case &k : cases) {
        int code = 0;
        std::string out = run({g_helper, "unmapruns", d.sock}, {std::string("KVCACHED_TESTDRV_FAIL=") + k.fail},
                              &code);
        EXPECT_EQ(out.rfind(k.status, 0), 0u) << k.fail << ": " << out;
        EXPECT_NE(out.find(k.books), std::string::npos) << k.fail << ": " << out;
        EXPECT_NE(out.find("DESTROYED HELD 0"), std::string::npos) << k.fail << ": " << out;
        if (std::string(k.status) != "STATUS KVC_OK")
            EXPECT_NE(out.find("cuMemUnmap"), std::string::npos) << out;
        size_t at = out.find("PID ");
        ASSERT_NE(at, std::string::npos) << out;
        DriverCalls got = driver_calls(static_cast<pid_t>(std::stol(out.substr(at + 4))));
        ASSERT_TRUE(got.known) << "no call counters of the helper: " << out;
        EXPECT_EQ(got.unmap, k.unmaps) << k.fail << ": " << out;
    }
}

}  // namespace

// The restarted daemon does not journal standby: a resumed session says
// again which adopted pages it keeps as standby (a FREE with the standby
// flag on the new channel), so a reclaim still asks for those first; a
// page taken back while the daemon was away is not said again.
TEST(KvcOwnDaemon, StandbyIsSaidAgainAfterResume)
{
    Daemon d;
    ASSERT_NO_FATAL_FAILURE(d.start({"--state-dir", "@STATE@"}));
    kvc_client *c = nullptr;
    KVC_OK_OR_FAIL(kvc_client_create(d.sock.c_str(), &c));
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "standby-resume";
    kvc_session *s = nullptr;
    KVC_OK_OR_FAIL(kvc_session_open(c, &o, &s));
    const uint64_t P = kvc_session_page_size(s);
    kvc_region *r = nullptr;
    KVC_OK_OR_FAIL(kvc_region_create(s, 8 * P, &r));
    KVC_OK_OR_FAIL(kvc_region_set_standby_limit(r, 4 * P));
    KVC_OK_OR_FAIL(kvc_region_map(r, 0, 4 * P));
    const char stamp[] = "across the restart";
    KVC_OK_OR_FAIL(kvc_region_write(r, 0, stamp, sizeof stamp));
    kvc_range tail = {P, 3 * P};
    KVC_OK_OR_FAIL(kvc_region_unmap_ranges_standby(r, &tail, 1));  // pages 1..3 standby
    EXPECT_EQ(kvc_region_standby_bytes(r), 3 * P);
    EXPECT_EQ(own_stats(s).standby_bytes, 3 * P);

    d.proc.kill_and_wait(SIGKILL);
    ASSERT_TRUE(wait_until([&] { return kvc_session_is_resuming(s) == 1; }, 5000));
    KVC_OK_OR_FAIL(kvc_region_map(r, P, P));  // page 1 back from standby while the daemon is away
    EXPECT_EQ(kvc_region_standby_bytes(r), 2 * P);

    ASSERT_NO_FATAL_FAILURE(d.restart());
    KVC_OK_OR_FAIL(kvc_session_wait_resumed(s, 60000));
    EXPECT_TRUE(wait_until([&] { return own_stats(s).standby_bytes == 2 * P; }, 5000))
        << "the restarted daemon counts " << own_stats(s).standby_bytes << " standby bytes, want " << 2 * P;
    kvc_stats st = own_stats(s);
    EXPECT_EQ(st.pages_held, 4u);
    char got[sizeof stamp];
    KVC_OK_OR_FAIL(kvc_region_read(r, 0, got, sizeof got));
    EXPECT_STREQ(got, stamp);
    kvc_region_destroy(r);
    EXPECT_EQ(own_stats(s).pages_held, 0u);
    KVC_OK_OR_FAIL(kvc_session_close(s));
    kvc_client_destroy(c);
}

int main(int argc, char **argv)
{
    ::testing::InitGoogleTest(&argc, argv);
    g_backend = env_or("KVC_TEST_BACKEND", "host");
    g_repo = env_or("KVC_REPO_ROOT", KVC_REPO_ROOT_DEFAULT);
    g_serve = env_or("KVC_SERVE", (g_repo + "/.venv/bin/kvcached-serve").c_str());
    g_python = env_or("KVC_PYTHON", (g_repo + "/.venv/bin/python").c_str());
    g_helper = env_or("KVC_TEST_HELPER", KVC_TEST_HELPER_DEFAULT);
    char tmpl[] = "/tmp/kvc-ctest.XXXXXX";
    if (!mkdtemp(tmpl)) {
        perror("mkdtemp");
        return 1;
    }
    g_tmp = tmpl;
    if (g_backend == "cuda") {
        // One simulated machine for the daemon and every client of this run.
        std::string state = g_tmp + "/gpu";
        mkdir(state.c_str(), 0700);
        chmod(state.c_str(), 01777);  // clients of other uids share the machine
        setenv("KVCACHED_TESTDRV_STATE", state.c_str(), 1);
        // Live call counters (the test driver's; DropReleasesKeptHandles and
        // KeptHandleMaps... count this process's driver calls).
        // Every process of the run inherits it: clients of other uids too.
        std::string calls = g_tmp + "/calls";
        mkdir(calls.c_str(), 0700);
        chmod(calls.c_str(), 01777);
        setenv("KVCACHED_TESTDRV_CALLS", calls.c_str(), 1);
        if (!std::getenv("KVCACHED_LIBCUDA")) {
            std::fprintf(stderr, "KVC_TEST_BACKEND=cuda needs KVCACHED_LIBCUDA (the test driver)\n");
            return 1;
        }
        if (access(std::getenv("KVCACHED_LIBCUDA"), R_OK) != 0) {
            std::fprintf(stderr, "KVCACHED_LIBCUDA=%s is missing: run scripts/build-testdriver.sh\n",
                         std::getenv("KVCACHED_LIBCUDA"));
            return 1;
        }
    }
    if (access(g_serve.c_str(), X_OK) != 0) {
        std::fprintf(stderr, "%s is missing: run scripts/setup.sh\n", g_serve.c_str());
        return 1;
    }
    int rc = RUN_ALL_TESTS();
    std::string rm = "rm -rf '" + g_tmp + "'";
    if (std::system(rm.c_str()) != 0)
        std::fprintf(stderr, "could not remove %s\n", g_tmp.c_str());
    return rc;
}

