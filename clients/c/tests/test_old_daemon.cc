// The library sends page operations (Allocate, Free, Close) on the fd
// channel only (issue 15). A daemon that does not take them there
// (GetInfo().fd_channel_requests false: daemons before the feature) is
// refused at kvc_session_open with a message naming why, before any fd
// channel is connected. The "daemon" here is a gRPC server in this process
// that answers GetInfo only.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include <unistd.h>

#include "kvcached.h"
#include "kvcached/v1/kvcached.grpc.pb.h"

namespace pb = kvcached::v1;

namespace {

class OldDaemon final : public pb::KVCached::Service {
public:
    bool channel_requests = false;
    std::atomic<int> opens{0};

    grpc::Status GetInfo(grpc::ServerContext *, const pb::GetInfoRequest *,
                         pb::GetInfoResponse *out) override
    {
        out->set_version("0.1-before-channel-requests");
        out->set_api_version(1);
        out->set_fd_socket("/nonexistent/kvcached.sock.fd");
        out->set_fd_protocol_version(1);
        out->set_backend("host");
        out->set_fd_channel_requests(channel_requests);
        out->set_max_pages_per_request(64);
        pb::DeviceInfo *d = out->add_devices();
        d->set_uuid("HOST-0");
        d->set_kind("host");
        d->set_page_size(4096);
        d->set_granularity(4096);
        return grpc::Status::OK;
    }

    grpc::Status OpenSession(grpc::ServerContext *, const pb::OpenSessionRequest *,
                             pb::OpenSessionResponse *) override
    {
        opens++;
        return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "not in this test");
    }
};

struct Served {
    std::string dir, sock;
    OldDaemon service;
    std::unique_ptr<grpc::Server> server;

    void start(bool channel_requests)
    {
        char tmpl[] = "/tmp/kvc-old-daemon.XXXXXX";
        ASSERT_NE(mkdtemp(tmpl), nullptr);
        dir = tmpl;
        sock = dir + "/old.sock";
        service.channel_requests = channel_requests;
        grpc::ServerBuilder b;
        b.AddListeningPort("unix:" + sock, grpc::InsecureServerCredentials());
        b.RegisterService(&service);
        server = b.BuildAndStart();
        ASSERT_NE(server, nullptr);
    }

    ~Served()
    {
        if (server)
            server->Shutdown();
        unlink(sock.c_str());
        rmdir(dir.c_str());
    }
};

TEST(OldDaemon, WithoutChannelRequestsSessionOpenIsRefusedNamingWhy)
{
    Served d;
    ASSERT_NO_FATAL_FAILURE(d.start(false));
    kvc_client *c = nullptr;
    ASSERT_EQ(kvc_client_create(d.sock.c_str(), &c), KVC_OK) << kvc_last_error();
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "s";
    kvc_session *s = nullptr;
    EXPECT_EQ(kvc_session_open(c, &o, &s), KVC_ERR_FAILED_PRECONDITION);
    std::string msg = kvc_last_error();
    EXPECT_NE(msg.find("fd_channel_requests is false"), std::string::npos) << msg;
    EXPECT_NE(msg.find("0.1-before-channel-requests"), std::string::npos) << msg;
    EXPECT_EQ(s, nullptr);
    EXPECT_EQ(d.service.opens.load(), 0) << "OpenSession was called";
    kvc_client_destroy(c);
}

// The same daemon offering channel requests gets past that check: the
// refusal above is the check's, not the fake's (here the fd channel cannot
// be connected: UNAVAILABLE or SYSTEM, never FAILED_PRECONDITION).
TEST(OldDaemon, WithChannelRequestsTheCheckPasses)
{
    Served d;
    ASSERT_NO_FATAL_FAILURE(d.start(true));
    kvc_client *c = nullptr;
    ASSERT_EQ(kvc_client_create(d.sock.c_str(), &c), KVC_OK) << kvc_last_error();
    kvc_session_options o;
    kvc_session_options_init(&o);
    o.name = "s";
    kvc_session *s = nullptr;
    kvc_status st = kvc_session_open(c, &o, &s);
    EXPECT_NE(st, KVC_OK);
    EXPECT_NE(st, KVC_ERR_FAILED_PRECONDITION) << kvc_last_error();
    EXPECT_EQ(std::string(kvc_last_error()).find("fd_channel_requests"), std::string::npos);
    kvc_client_destroy(c);
}

}  // namespace
