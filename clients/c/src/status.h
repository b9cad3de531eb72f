/* The one mapping between gRPC status codes and kvc_status, and the
 * per-thread error message. Internal to libkvcached. */
#ifndef KVC_STATUS_H
#define KVC_STATUS_H

#include "kvcached.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gRPC code (grpc::StatusCode / grpc_status_code value) -> kvc_status.
 * OK -> KVC_OK; codes with no meaning in this API -> KVC_ERR_UNKNOWN. */
kvc_status kvc_status_from_grpc_code(int grpc_code);

/* kvc_status -> the gRPC code it travels as. Local-only statuses
 * (PROTOCOL, DRIVER, SYSTEM, NO_MEMORY) -> UNKNOWN (2). */
int kvc_status_to_grpc_code(kvc_status status);

/* Record the calling thread's error message and return `status`. */
kvc_status kvc_fail(kvc_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Clear the calling thread's error message. */
void kvc_clear_error(void);

#ifdef __cplusplus
}
#endif

#endif
