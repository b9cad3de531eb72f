// The one place where gRPC status codes become kvc_status (docs/protocol.md,
// "Status codes"), plus kvc_status_to_string and the per-thread message.
#include "status.h"

#include <grpcpp/support/status.h>

#include <cstdarg>
#include <cstdio>
#include <string>

namespace {

struct Row {
    grpc::StatusCode grpc;
    kvc_status kvc;
};

// The mirrored block of kvc_status, both directions from this one table.
constexpr Row kTable[] = {
    {grpc::StatusCode::OK, KVC_OK},
    {grpc::StatusCode::INVALID_ARGUMENT, KVC_ERR_INVALID_ARGUMENT},
    {grpc::StatusCode::NOT_FOUND, KVC_ERR_NOT_FOUND},
    {grpc::StatusCode::PERMISSION_DENIED, KVC_ERR_PERMISSION_DENIED},
    {grpc::StatusCode::RESOURCE_EXHAUSTED, KVC_ERR_RESOURCE_EXHAUSTED},
    {grpc::StatusCode::FAILED_PRECONDITION, KVC_ERR_FAILED_PRECONDITION},
    {grpc::StatusCode::UNAVAILABLE, KVC_ERR_UNAVAILABLE},
    {grpc::StatusCode::DEADLINE_EXCEEDED, KVC_ERR_DEADLINE_EXCEEDED},
    {grpc::StatusCode::INTERNAL, KVC_ERR_INTERNAL},
    {grpc::StatusCode::UNKNOWN, KVC_ERR_UNKNOWN},
};

thread_local std::string t_error;

}  // namespace

extern "C" kvc_status kvc_status_from_grpc_code(int code)
{
    for (const Row &r : kTable)
        if (static_cast<int>(r.grpc) == code)
            return r.kvc;
    return KVC_ERR_UNKNOWN;
}

extern "C" int kvc_status_to_grpc_code(kvc_status status)
{
    for (const Row &r : kTable)
        if (r.kvc == status)
            return static_cast<int>(r.grpc);
    return static_cast<int>(grpc::StatusCode::UNKNOWN);
}

extern "C" KVC_API const char *kvc_status_to_string(kvc_status status)
{
    switch (status) {
    case KVC_OK: return "KVC_OK";
    case KVC_ERR_INVALID_ARGUMENT: return "KVC_ERR_INVALID_ARGUMENT";
    case KVC_ERR_NOT_FOUND: return "KVC_ERR_NOT_FOUND";
    case KVC_ERR_PERMISSION_DENIED: return "KVC_ERR_PERMISSION_DENIED";
    case KVC_ERR_RESOURCE_EXHAUSTED: return "KVC_ERR_RESOURCE_EXHAUSTED";
    case KVC_ERR_FAILED_PRECONDITION: return "KVC_ERR_FAILED_PRECONDITION";
    case KVC_ERR_UNAVAILABLE: return "KVC_ERR_UNAVAILABLE";
    case KVC_ERR_DEADLINE_EXCEEDED: return "KVC_ERR_DEADLINE_EXCEEDED";
    case KVC_ERR_INTERNAL: return "KVC_ERR_INTERNAL";
    case KVC_ERR_UNKNOWN: return "KVC_ERR_UNKNOWN";
    case KVC_ERR_PROTOCOL: return "KVC_ERR_PROTOCOL";
    case KVC_ERR_DRIVER: return "KVC_ERR_DRIVER";
    case KVC_ERR_SYSTEM: return "KVC_ERR_SYSTEM";
    case KVC_ERR_NO_MEMORY: return "KVC_ERR_NO_MEMORY";
    }
    return "KVC_STATUS_INVALID";
}

extern "C" kvc_status kvc_fail(kvc_status status, const char *fmt, ...)
{
    try {
        char buf[2048];
        va_list ap;
        va_start(ap, fmt);
        std::vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        t_error.assign(buf);
    } catch (...) {
        // Out of memory while recording the message: keep the status.
    }
    return status;
}

extern "C" void kvc_clear_error(void) { t_error.clear(); }

extern "C" KVC_API const char *kvc_last_error(void) { return t_error.c_str(); }

extern "C" KVC_API int kvc_api_version(void) { return KVC_API_VERSION; }
