// The client semantics of docs/protocol.md ("Client semantics"), as the
// shared scenario files tests/scenarios/*.json, through the public C API:
// the daemon's side is played by tests/helpers/fakedaemon.py (a subprocess,
// the venv's Python), the client's side by this harness, with what each
// operation must return or fail with. tests/test_scenarios.py (Python) and
// clients/go/scenarios_test.go (Go) run the same files.
//
// Each scenario file is a test case of its own (ScenarioFiles/Scenario.Run/
// <name>; ctest runs each as its own test).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvcached.h"

extern char **environ;

using json = nlohmann::json;

namespace {

std::string g_repo = KVC_REPO_ROOT_DEFAULT;

std::string env_or(const char *name, const std::string &def)
{
    const char *v = std::getenv(name);
    return v && *v ? v : def;
}

std::vector<std::string> scenario_files()
{
    std::vector<std::string> out;
    std::string dir = env_or("KVC_REPO_ROOT", g_repo) + "/tests/scenarios";
    DIR *d = opendir(dir.c_str());
    if (!d)
        return out;
    while (struct dirent *e = readdir(d)) {
        std::string n = e->d_name;
        if (n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0)
            out.push_back(n.substr(0, n.size() - 5));
    }
    closedir(d);
    std::sort(out.begin(), out.end());
    return out;
}

// The status names the files use.
kvc_status status_named(const std::string &name)
{
    static const std::pair<const char *, kvc_status> names[] = {
        {"INVALID_ARGUMENT", KVC_ERR_INVALID_ARGUMENT},
        {"NOT_FOUND", KVC_ERR_NOT_FOUND},
        {"PERMISSION_DENIED", KVC_ERR_PERMISSION_DENIED},
        {"RESOURCE_EXHAUSTED", KVC_ERR_RESOURCE_EXHAUSTED},
        {"FAILED_PRECONDITION", KVC_ERR_FAILED_PRECONDITION},
        {"UNAVAILABLE", KVC_ERR_UNAVAILABLE},
        {"DEADLINE_EXCEEDED", KVC_ERR_DEADLINE_EXCEEDED},
        {"INTERNAL", KVC_ERR_INTERNAL},
        {"UNKNOWN", KVC_ERR_UNKNOWN},
    };
    for (const auto &n : names)
        if (name == n.first)
            return n.second;
    ADD_FAILURE() << "the scenario names an unknown status " << name;
    return KVC_OK;
}

// The fake daemon: a child with its stdin and stdout as pipes.
struct Fake {
    pid_t pid = -1;
    int in = -1, out = -1;
    std::string buf;  // stdout read so far, not yet returned as lines
    std::string log;

    bool start(const std::string &scenario, const std::string &sock, const std::string &log_path)
    {
        log = log_path;
        std::string python = env_or("KVC_PYTHON", g_repo + "/.venv/bin/python");
        std::vector<std::string> argv = {python, g_repo + "/tests/helpers/fakedaemon.py", "--socket",
                                         sock, "--scenario", scenario};
        std::vector<std::string> envs;
        for (char **e = environ; *e; e++)
            if (std::strncmp(*e, "PYTHONPATH=", 11) != 0)
                envs.push_back(*e);
        envs.push_back("PYTHONPATH=" + g_repo);
        std::vector<char *> av, ev;
        for (auto &a : argv)
            av.push_back(const_cast<char *>(a.c_str()));
        av.push_back(nullptr);
        for (auto &e : envs)
            ev.push_back(const_cast<char *>(e.c_str()));
        ev.push_back(nullptr);
        int pin[2], pout[2];
        if (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC))
            return false;
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_adddup2(&fa, pin[0], 0);
        posix_spawn_file_actions_adddup2(&fa, pout[1], 1);
        posix_spawn_file_actions_addopen(&fa, 2, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int rc = posix_spawn(&pid, av[0], &fa, nullptr, av.data(), ev.data());
        posix_spawn_file_actions_destroy(&fa);
        close(pin[0]);
        close(pout[1]);
        in = pin[1];
        out = pout[0];
        if (rc != 0)
            pid = -1;
        return rc == 0;
    }

    // One line of stdout ("" at end of stream or after timeout_s).
    bool read_line(std::string *line, int timeout_s)
    {
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
        for (;;) {
            size_t nl = buf.find('\n');
            if (nl != std::string::npos) {
                *line = buf.substr(0, nl);
                buf.erase(0, nl + 1);
                return true;
            }
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            until - std::chrono::steady_clock::now())
                            .count();
            if (left <= 0 || out < 0)
                return false;
            struct pollfd p = {out, POLLIN, 0};
            if (poll(&p, 1, static_cast<int>(left)) <= 0)
                continue;
            char chunk[4096];
            ssize_t n = read(out, chunk, sizeof chunk);
            if (n <= 0) {
                if (!buf.empty()) {
                    *line = buf;
                    buf.clear();
                    return true;
                }
                return false;
            }
            buf.append(chunk, static_cast<size_t>(n));
        }
    }

    void signal(const std::string &name)
    {
        std::string l = "signal " + name + "\n";
        ssize_t n = write(in, l.data(), l.size());
        (void)n;
    }

    void close_stdin()
    {
        if (in >= 0)
            close(in);
        in = -1;
    }

    // Exit status; kills the fake first if it does not end within timeout_s.
    int wait(int timeout_s)
    {
        int st = 0;
        if (pid <= 0)
            return -1;
        auto until = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
        while (waitpid(pid, &st, WNOHANG) != pid) {
            if (std::chrono::steady_clock::now() > until) {
                kill(pid, SIGKILL);
                waitpid(pid, &st, 0);
                break;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        pid = -1;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }

    std::string stderr_tail() const
    {
        std::ifstream f(log);
        std::stringstream ss;
        ss << f.rdbuf();
        std::string s = ss.str();
        return s.size() > 3000 ? s.substr(s.size() - 3000) : s;
    }

    ~Fake()
    {
        close_stdin();
        if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, nullptr, 0);
        }
        if (out >= 0)
            close(out);
    }
};

bool wait_until(int ms, const std::function<bool()> &cond)
{
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    while (!cond()) {
        if (std::chrono::steady_clock::now() > until)
            return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
}

// The client side of one scenario.
struct Harness {
    json sc;
    std::string sock;
    Fake *fake = nullptr;
    kvc_client *client = nullptr;
    kvc_session *session = nullptr;
    std::vector<int> fds;  // page descriptors the allocations returned

    uint32_t timeout_ms() const
    {
        double t = sc.value("client_timeout", 5.0);
        return static_cast<uint32_t>(t * 1000);
    }

    // Check a call's status against op.expect; true if it expected an error
    // (so the caller checks nothing more).
    bool check(const json &op, kvc_status st, const std::string &where)
    {
        const json want = op.value("expect", json::object());
        std::string msg = st == KVC_OK ? "" : kvc_last_error();
        if (!want.contains("error")) {
            EXPECT_EQ(st, KVC_OK) << where << ": unexpected error " << kvc_status_to_string(st) << ": "
                                  << msg;
            return st != KVC_OK;
        }
        kvc_status code = status_named(want["error"].get<std::string>());
        EXPECT_EQ(st, code) << where << ": gave " << kvc_status_to_string(st) << " (" << msg
                            << "); want " << kvc_status_to_string(code);
        std::string part = want.value("message_contains", "");
        EXPECT_NE(msg.find(part), std::string::npos)
            << where << ": message \"" << msg << "\" does not contain \"" << part << "\"";
        return true;
    }

    void run(size_t i, const json &op)
    {
        const std::string kind = op.at("op").get<std::string>();
        const std::string where = "client op " + std::to_string(i) + " " + op.dump();
        if (kind == "open_session") {
            // The file's client_timeout is for the calls it times; connecting
            // gets a generous bound of its own, for a loaded 2-core machine.
            kvc_status st = kvc_client_create(sock.c_str(), &client);
            ASSERT_EQ(st, KVC_OK) << where << ": kvc_client_create: " << kvc_last_error();
            kvc_client_set_timeout(client, 30000);
            kvc_session_options o;
            kvc_session_options_init(&o);
            std::string name = op.at("name").get<std::string>();
            o.name = name.c_str();
            st = kvc_session_open(client, &o, &session);
            kvc_client_set_timeout(client, timeout_ms());
            check(op, st, where);
        } else if (kind == "allocate") {
            ASSERT_NE(session, nullptr) << where << ": no session";
            uint32_t n = op.at("num_pages").get<uint32_t>();
            std::vector<uint64_t> ids(n);
            std::vector<int> got(n, -1);
            kvc_status st = kvc_session_alloc_pages(session, n, ids.data(), got.data());
            if (check(op, st, where))
                return;
            fds.insert(fds.end(), got.begin(), got.end());
            const json want = op.value("expect", json::object());
            if (want.contains("page_ids"))
                EXPECT_EQ(ids, want["page_ids"].get<std::vector<uint64_t>>()) << where;
            if (want.value("contents", false))
                for (uint32_t k = 0; k < n; k++) {
                    std::string marker = "kvc-fake page " + std::to_string(ids[k]);
                    std::string head(marker.size(), '\0');
                    ssize_t r = pread(got[k], &head[0], head.size(), 0);
                    EXPECT_EQ(r, static_cast<ssize_t>(head.size())) << where;
                    EXPECT_EQ(head, marker) << where << ": the descriptor of page " << ids[k]
                                            << " is another page";
                }
        } else if (kind == "free") {
            ASSERT_NE(session, nullptr) << where << ": no session";
            std::vector<uint64_t> ids = op.at("page_ids").get<std::vector<uint64_t>>();
            uint64_t freed = 0;
            kvc_status st = kvc_session_free_pages(session, ids.data(), ids.size(), &freed);
            if (check(op, st, where))
                return;
            const json want = op.value("expect", json::object());
            if (want.contains("value"))
                EXPECT_EQ(freed, want["value"].get<uint64_t>()) << where;
        } else if (kind == "wait_resuming") {
            EXPECT_TRUE(wait_until(10000, [&] { return kvc_session_is_resuming(session) == 1; }))
                << where << ": the client did not notice the hang-up within 10 s";
        } else if (kind == "wait_resumed") {
            kvc_status st = kvc_session_wait_resumed(session, 20000);
            EXPECT_EQ(st, KVC_OK) << where << ": not resumed: " << kvc_status_to_string(st) << ": "
                                  << kvc_last_error();
        } else if (kind == "wait_ended") {
            EXPECT_TRUE(wait_until(10000, [&] { return kvc_session_ended(session) == 1; }))
                << where << ": the client did not see the channel end within 10 s";
        } else if (kind == "signal") {
            fake->signal(op.at("name").get<std::string>());
        } else if (kind == "sleep") {
            std::this_thread::sleep_for(
                std::chrono::milliseconds(static_cast<int64_t>(op.at("seconds").get<double>() * 1000)));
        } else if (kind == "close") {
            close_all();
        } else {
            FAIL() << where << ": unknown client op";
        }
    }

    void close_all()
    {
        for (int fd : fds)
            if (fd >= 0)
                close(fd);
        fds.clear();
        if (session) {
            kvc_client_set_timeout(client, 10000);
            kvc_status st = kvc_session_close(session);
            EXPECT_EQ(st, KVC_OK) << "kvc_session_close: " << kvc_last_error();
            session = nullptr;
        }
        kvc_client_destroy(client);
        client = nullptr;
    }
};

class Scenario : public ::testing::TestWithParam<std::string> {};

TEST_P(Scenario, Run)
{
    const std::string name = GetParam();
    const std::string file = env_or("KVC_REPO_ROOT", g_repo) + "/tests/scenarios/" + name + ".json";
    json sc;
    {
        std::ifstream f(file);
        ASSERT_TRUE(f.good()) << file;
        sc = json::parse(f);
    }
    ASSERT_EQ(sc.value("name", ""), name);
    char tmpl[] = "/tmp/kvc-scenario.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    const std::string dir = tmpl;
    Fake fake;
    ASSERT_TRUE(fake.start(file, dir + "/fake.sock", dir + "/fake.log")) << "cannot start the fake daemon";
    std::string line;
    // Generous: the fake imports grpc on a busy 2-core machine.
    ASSERT_TRUE(fake.read_line(&line, 60)) << "the fake daemon did not start: " << fake.stderr_tail();
    ASSERT_TRUE(json::parse(line).value("ready", false)) << line;

    Harness h;
    h.sc = sc;
    h.sock = dir + "/fake.sock";
    h.fake = &fake;
    const json &ops = sc.at("client");
    for (size_t i = 0; i < ops.size() && !HasFatalFailure(); i++)
        h.run(i, ops[i]);
    h.close_all();
    fake.close_stdin();
    // The script's last line says whether the client did what it expected.
    std::string last;
    while (fake.read_line(&line, 60))
        if (!line.empty())
            last = line;
    int code = fake.wait(10);
    json result = json::parse(last, nullptr, false);
    EXPECT_TRUE(!result.is_discarded() && result.value("ok", false) && code == 0)
        << "the fake daemon's script failed: " << last << " (exit " << code << ")\n"
        << fake.stderr_tail();
    std::string rm = "rm -rf '" + dir + "'";
    if (std::system(rm.c_str()) != 0)
        std::fprintf(stderr, "cannot remove %s\n", dir.c_str());
}

INSTANTIATE_TEST_SUITE_P(ScenarioFiles, Scenario, ::testing::ValuesIn(scenario_files()),
                         [](const ::testing::TestParamInfo<std::string> &p) { return p.param; });

// The files are there (a missing directory would otherwise run no case).
TEST(ScenarioFiles, AtLeastTen) { EXPECT_GE(scenario_files().size(), 10u); }

}  // namespace
