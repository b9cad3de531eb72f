// The gRPC <-> kvc_status mapping (src/status.cc): round trip, names.
#include <grpcpp/support/status.h>
#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <string>

#include "kvcached.h"
#include "status.h"

TEST(Status, EveryGrpcCodeMapsAndMirroredOnesRoundTrip)
{
    for (int code = 0; code <= 16; code++) {
        kvc_status k = kvc_status_from_grpc_code(code);
        EXPECT_GE(static_cast<int>(k), 0);
        EXPECT_LT(static_cast<int>(k), KVC_STATUS_COUNT);
        if (k != KVC_ERR_UNKNOWN) {
            EXPECT_EQ(kvc_status_to_grpc_code(k), code) << "code " << code;
        }
    }
    // Every code of docs/protocol.md's table has its own status.
    const std::pair<grpc::StatusCode, kvc_status> doc[] = {
        {grpc::StatusCode::OK, KVC_OK},
        {grpc::StatusCode::INVALID_ARGUMENT, KVC_ERR_INVALID_ARGUMENT},
        {grpc::StatusCode::NOT_FOUND, KVC_ERR_NOT_FOUND},
        {grpc::StatusCode::PERMISSION_DENIED, KVC_ERR_PERMISSION_DENIED},
        {grpc::StatusCode::RESOURCE_EXHAUSTED, KVC_ERR_RESOURCE_EXHAUSTED},
        {grpc::StatusCode::FAILED_PRECONDITION, KVC_ERR_FAILED_PRECONDITION},
        {grpc::StatusCode::UNAVAILABLE, KVC_ERR_UNAVAILABLE},
        {grpc::StatusCode::DEADLINE_EXCEEDED, KVC_ERR_DEADLINE_EXCEEDED},
        {grpc::StatusCode::INTERNAL, KVC_ERR_INTERNAL},
    };
    for (auto [g, k] : doc) {
        EXPECT_EQ(kvc_status_from_grpc_code(static_cast<int>(g)), k);
        EXPECT_EQ(kvc_status_to_grpc_code(k), static_cast<int>(g));
    }
    // Codes this API gives no meaning to are UNKNOWN.
    for (auto g : {grpc::StatusCode::CANCELLED, grpc::StatusCode::UNKNOWN,
                   grpc::StatusCode::ALREADY_EXISTS, grpc::StatusCode::ABORTED,
                   grpc::StatusCode::OUT_OF_RANGE, grpc::StatusCode::UNIMPLEMENTED,
                   grpc::StatusCode::DATA_LOSS, grpc::StatusCode::UNAUTHENTICATED})
        EXPECT_EQ(kvc_status_from_grpc_code(static_cast<int>(g)), KVC_ERR_UNKNOWN);
    EXPECT_EQ(kvc_status_from_grpc_code(99), KVC_ERR_UNKNOWN);
}

TEST(Status, LocalStatusesTravelAsUnknown)
{
    for (kvc_status k : {KVC_ERR_PROTOCOL, KVC_ERR_DRIVER, KVC_ERR_SYSTEM, KVC_ERR_NO_MEMORY})
        EXPECT_EQ(kvc_status_to_grpc_code(k), static_cast<int>(grpc::StatusCode::UNKNOWN));
}

TEST(Status, NamesAreDistinct)
{
    std::set<std::string> names;
    for (int i = 0; i < KVC_STATUS_COUNT; i++) {
        std::string n = kvc_status_to_string(static_cast<kvc_status>(i));
        EXPECT_EQ(n.rfind("KVC_", 0), 0u) << n;
        EXPECT_NE(n, "KVC_STATUS_INVALID");
        names.insert(n);
    }
    EXPECT_EQ(names.size(), static_cast<size_t>(KVC_STATUS_COUNT));
    EXPECT_STREQ(kvc_status_to_string(static_cast<kvc_status>(KVC_STATUS_COUNT)),
                 "KVC_STATUS_INVALID");
    EXPECT_STREQ(kvc_status_to_string(static_cast<kvc_status>(-1)), "KVC_STATUS_INVALID");
}

TEST(Status, LastErrorIsPerThread)
{
    EXPECT_EQ(kvc_fail(KVC_ERR_NOT_FOUND, "page %d", 7), KVC_ERR_NOT_FOUND);
    EXPECT_STREQ(kvc_last_error(), "page 7");
    std::string other;
    std::thread([&] { other = kvc_last_error(); }).join();
    EXPECT_EQ(other, "");
    EXPECT_EQ(kvc_api_version(), KVC_API_VERSION);
}
